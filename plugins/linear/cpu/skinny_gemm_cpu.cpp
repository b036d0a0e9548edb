// Skinny GEMM (see include/skinny_gemm.h). Work is split over column tiles of SG_TILE (four AVX-512 vectors);
// within a tile, the packed (K x SG_TILE) panel is walked in chunks of sg_chunk_rows() rows that stay in cache
// (L1 or L2, below) while every block of up to 6 rows of x runs over them with 6 x 4 accumulators in registers
// (partial sums live in y).
// Built for AVX2+FMA without AVX-512, the walk takes quarter tiles (parts) one at a time, each stored contiguously
// (below).
#include "skinny_gemm.h"

#include <omp.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <cmath>

#include "claimed_ranges.h"
#include "parallel_work.h"
#include "row_split.h"

namespace {
// Columns a panel stores side by side: the whole tile where AVX-512 walks it (a k row of the tile, 256 bytes, is
// 4 vectors), one 16-column part of it on AVX2 builds, whose walk takes a tile part by part: there a tile's 4
// parts are stored one after the other, each K x 16. (With the tile's rows 256 bytes apart a part's rows are
// 256 bytes apart too: on a Zen 3 EPYC a 6 x 16 block loop over such rows ran at 0.88-0.91x of the same loop over
// contiguous ones, and the 2048^3 GEMM at 157-161 GFLOP/s against 170-174 stored this way. Parts contiguous only
// within blocks of 128 k rows did not gain.)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPacked = 16;
#else
constexpr int64_t kPacked = SG_TILE;
#endif
}  // namespace

extern "C" int64_t sg_packed_size(int64_t K, int64_t N) { return (N + SG_TILE - 1) / SG_TILE * K * SG_TILE; }

extern "C" int sg_pack_f32_strided(const float* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n,
                                   float* packed) {
  if (K <= 0 || N <= 0) return SG_ERR_SHAPE;
  const int64_t tiles = (N + SG_TILE - 1) / SG_TILE;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t part = 0; part < SG_TILE / kPacked; ++part) {
      const int64_t n0 = t * SG_TILE + part * kPacked;
      const int64_t width = N - n0 >= kPacked ? kPacked : N - n0 > 0 ? N - n0 : 0;
      for (int64_t k = 0; k < K; ++k) {
        float* dst = packed + t * K * SG_TILE + (part * K + k) * kPacked;
        if (stride_n == 1) {
          if (width > 0) memcpy(dst, w + k * stride_k + n0, width * sizeof(float));
        } else {
          for (int64_t c = 0; c < width; ++c) dst[c] = w[k * stride_k + (n0 + c) * stride_n];
        }
        memset(dst + width, 0, (kPacked - width) * sizeof(float));
      }
    }
  return SG_OK;
}

extern "C" int sg_pack_f32(const float* w, int64_t K, int64_t N, float* packed) {
  return sg_pack_f32_strided(w, K, N, N, 1, packed);
}

// Each output of sg_gemm_f32 (without bias) is one chain of fused multiply-adds over k ascending, from zero: both
// walks keep a column's partial sum in one accumulator lane (stored to y between chunks, loaded back unchanged).
// The same chain, scalar, over the same packed values gives the same bits.
extern "C" int sg_dot_columns(const float* x, int64_t K, const float* packed, int64_t N, const int32_t* cols,
                              int64_t count, float* out) {
  if (K <= 0 || N <= 0 || count < 0) return SG_ERR_SHAPE;
  constexpr int kGroup = 8;    // independent chains in flight (an FMA's latency over its throughput)
  constexpr int64_t kAhead = 16;  // k rows fetched ahead of the loads
  for (int64_t g = 0; g < count; g += kGroup) {
    const int n = count - g < kGroup ? (int)(count - g) : kGroup;
    const float* col[kGroup];
    float acc[kGroup];
    for (int i = 0; i < kGroup; ++i) {
      const int64_t c = cols[g + (i < n ? i : 0)];
      if (c < 0 || c >= N) return SG_ERR_SHAPE;
      const int64_t t = c / SG_TILE, in_tile = c % SG_TILE;
      col[i] = packed + t * K * SG_TILE + (in_tile / kPacked) * K * kPacked + in_tile % kPacked;
      acc[i] = 0.0f;
    }
    for (int64_t k = 0; k < K; ++k) {
      const float xk = x[k];
      for (int i = 0; i < kGroup; ++i) {
        __builtin_prefetch(col[i] + (k + kAhead) * kPacked);  // each k row of a column is its own cache line
        acc[i] = std::fma(xk, col[i][k * kPacked], acc[i]);
      }
    }
    for (int i = 0; i < n; ++i) out[g + i] = acc[i];
  }
  return SG_OK;
}

namespace {

using inflight::RowSplit;  // (row_split.h)

// What one pass of a row block over a chunk prefetches into L2: `count` cache lines from `start`, `per` of them
// at every (1 << shift)-th k row.
// Or, where `ahead` > 0 (a walk of one row block, below), the k row `ahead` bytes past each one the pass loads.
struct Prefetch {
  const char* start;
  int64_t count;
  int per, shift;
  int64_t ahead = 0;
  bool due(int64_t k) const { return (k & ((int64_t(1) << shift) - 1)) == 0 && (k >> shift) * per < count; }
  const char* line(int64_t k) const { return start + (k >> shift) * per * 64; }
};

// The weights a walk reads after rows [k0, k0 + kc) of tile t's panel: the panel's next chunk of `chunk` rows,
// or the next tile's first (panels are stored back to back); where it starts and its size in cache lines (0 after
// the last tile). Both walks prefetch it into L2 while they use the current chunk, its lines spread evenly over
// every pass of a row block over the chunk, so the memory streams the whole time the arithmetic runs. (Issued
// all in the first pass, they held the line fill buffers its own loads needed: 1.2-1.3x slower decode steps at
// batch 4-32 with AVX-512; a few per k row from the first pass on until all were issued, the last passes issued
// none: with AVX2 at 8 rows, a 128-row chunk's 512 lines took the first half of its 8 passes, and the decode
// GEMMs ran 1.2x slower than when spread over all 8.)
struct NextChunk {
  const char* start;
  int64_t lines;
  int per = 1, shift = 0;
  NextChunk(const float* panel, int64_t k0, int64_t kc, int64_t K, int64_t t, int64_t tiles, int64_t chunk,
            int64_t passes)
      : NextChunk(panel + (k0 + kc) * SG_TILE,
                  k0 + kc < K   ? (K - k0 - kc < chunk ? K - k0 - kc : chunk)
                  : t + 1 < tiles ? (K < chunk ? K : chunk)
                                  : 0,
                  SG_TILE, passes, kc) {}
  // Any `rows` rows of `width` floats from `first`, spread over `passes` passes of kc k rows.
  NextChunk(const float* first, int64_t rows, int64_t width, int64_t passes, int64_t kc)
      : start(reinterpret_cast<const char*>(first)) {
    lines = rows * width * (int64_t)sizeof(float) / 64;
    const int64_t steps = passes * kc;  // k rows walked over the chunk, all passes together
    if (lines >= steps) per = (int)((lines + steps - 1) / steps);
    else if (lines > 0) while ((steps >> (shift + 1)) >= lines) ++shift;
  }
  // The lines pass `pass` (0-based) issues.
  Prefetch pass(int64_t pass, int64_t kc) const {
    const int64_t each = ((kc + (int64_t(1) << shift) - 1) >> shift) * per, first = pass * each;
    const int64_t left = lines - first;
    return {left > 0 ? start + first * 64 : nullptr, left > 0 ? left : 0, per, shift};
  }
};

// k rows of a panel per pass (sg_chunk_rows). Each pass of a row block starts its accumulators from y and ends
// storing them, and the next chunk is prefetched while this one is used. With AVX-512 the choice follows the L1
// data cache: 48 KB or more (Intel since Ice Lake, Zen 5) holds a 128-row chunk (32 KB) beside x's rows, and
// there 1,024-row chunks ran 1.02-1.31x longer on the large bench model's layers at 1-32 rows with the weights
// read from memory (an Intel Xeon with AMX; `benchmarks/skinny_gemm.py --chunk-rows`; 64-256 within 5% of 128).
// With a 32 KB L1 (Zen 4) the 128-row chunk does not stay in it, and 1,024 rows (256 KB, held in L2) amortise the
// passes' loads and stores: there 128 ran 1.06-1.10x longer at 32-2,048 rows, 1.04-1.09x at 8 (256 and 512 in
// between, 2,048 and 4,096 as 1,024). The AVX2 walk takes 1,024 since its parts are stored contiguously (kPacked:
// a part's 1,024 rows, 64 KB, held in L2): on a Zen 3 EPYC a 1024 x 1024 layer at 2,048 rows ran at 187-188
// GFLOP/s in 1,024-row chunks, 178-181 in 256, 164-170 in 128 (a 1024 x 2752 one at 32 rows: 177-185, 175-177,
// 167-171), and the large bench model's decode steps at 1-32 rows from memory were no longer; before, with a
// tile's rows together, 128 (64: each pass's accumulator loads and stores cost 4-5% at 32 rows; 1,024 on a Zen 4
// EPYC: 0.94-1.09x, mixed).
int64_t default_chunk_rows() {
#if defined(__AVX512F__)
  const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return l1 >= 48 * 1024 ? 128 : 1024;
#else
  return 1024;
#endif
}

std::atomic<int64_t> chunk_rows{default_chunk_rows()};

// How far ahead of its loads a walk of one row block (up to 6 rows of x: decode steps of few sequences) fetches
// the weights, in bytes; 0: the next chunk, spread over the pass, as with more row blocks. A single pass over a
// chunk runs its loads and the next chunk's prefetches several times faster than memory delivers them: the
// prefetches, issued in a burst, fill the core's queue of misses and the pass then waits on its own loads (the
// large bench model's layers at 1 row streamed at ~40 GB/s where a reduction over the same bytes reads 55-60).
// Fetched a couple of k rows ahead instead, the prefetches keep pace with the loads (the hardware's stream
// prefetchers doing the rest): the large bench model's layers 1.1-1.3x faster at 1-6 rows on a Zen 4 EPYC, its
// LM head at 1 row 3.43 -> 2.80 ms (`benchmarks/skinny_gemm.py --stream-ahead`; 256-1,024 bytes alike, 2,048
// slower at 6 rows). With 2 or more row blocks the next-chunk plan stays: the chunk is used by every pass and
// its fetches are spread over all of them (the first pass streaming and the others reading L2 was 1.06-1.08x
// slower at 8-12 rows, 0.97x at 16-32).
std::atomic<int64_t> stream_ahead{512};

}  // namespace

extern "C" int64_t sg_chunk_rows(int64_t rows) {
  if (rows > 0) chunk_rows.store(rows, std::memory_order_relaxed);
  return chunk_rows.load(std::memory_order_relaxed);
}

extern "C" int64_t sg_stream_ahead(int64_t bytes) {
  if (bytes >= 0) stream_ahead.store(bytes, std::memory_order_relaxed);
  return stream_ahead.load(std::memory_order_relaxed);
}

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kRows = 6;
constexpr int64_t kSlab = 96;    // rows of x per pass over all tiles

// Rows [0, R) of x times the packed panel's k rows [k0, k0 + kc): accumulate into y (first chunk: start from
// bias or zero; last chunk: y holds the result). Meanwhile prefetch `pf`'s lines into L2.
template <int R>
void row_block(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t kc, int64_t N, int64_t n0,
               const __mmask16* masks, const float* bias, bool first, float* y, Prefetch pf) {
  __m512 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    const __m512 init = first ? (bias ? _mm512_maskz_loadu_ps(masks[j], bias + n0 + 16 * j) : _mm512_setzero_ps())
                              : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      acc[i][j] = first ? init : _mm512_maskz_loadu_ps(masks[j], y + i * N + n0 + 16 * j);
  }
  panel += k0 * SG_TILE;
  x += k0;
  for (int64_t k = 0; k < kc; ++k, panel += SG_TILE) {
    if (pf.ahead > 0) {
      const char* line = reinterpret_cast<const char*>(panel) + pf.ahead;
      for (int j = 0; j < 4; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
    } else if (pf.due(k)) {
      const char* line = pf.line(k);
      for (int j = 0; j < pf.per; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel), w1 = _mm512_loadu_ps(panel + 16);
    const __m512 w2 = _mm512_loadu_ps(panel + 32), w3 = _mm512_loadu_ps(panel + 48);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * N + n0 + 16 * j, masks[j], acc[i][j]);
}

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                            const __mmask16*, const float*, bool, float*, Prefetch);
constexpr RowBlockFn kRowBlocks[kRows + 1] = {nullptr, row_block<1>, row_block<2>, row_block<3>,
                                              row_block<4>, row_block<5>, row_block<6>};

}  // namespace

extern "C" int sg_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                           const float* bias, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K) return SG_ERR_SHAPE;
  const int64_t tiles = (N + SG_TILE - 1) / SG_TILE, chunk = sg_chunk_rows(0), ahead = sg_stream_ahead(-1);
  // Prefill-sized inputs go in slabs of kSlab rows, so a slab of x stays in L2 while every tile uses it.
  for (int64_t s0 = 0; s0 < M; s0 += kSlab) {
    const int64_t s1 = M - s0 < kSlab ? M : s0 + kSlab;
    inflight::ClaimedRanges work(tiles, omp_get_max_threads());  // (why: see the AVX2 walk below)
#pragma omp parallel if (inflight::worth_threads((s1 - s0) * K * N))
    for (int64_t t; (t = work.next(omp_get_thread_num())) >= 0;) {
      const int64_t n0 = t * SG_TILE;
      __mmask16 masks[4];
      for (int j = 0; j < 4; ++j) {
        const int64_t left = N - n0 - 16 * j;
        masks[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
      }
      const float* panel = packed + t * K * SG_TILE;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = K - k0 < chunk ? K - k0 : chunk;
        const RowSplit split(s1 - s0, kRows);
        const int64_t blocks = split.blocks;
        // While the row blocks run over this chunk, the next chunk of weights is fetched into L2.
        const NextChunk next(panel, k0, kc, K, t, tiles, chunk, blocks);
        for (int64_t b = 0, m0 = s0; b < blocks; ++b) {
          const int rows = split.rows(b);
          Prefetch pf = next.pass(b, kc);
          if (blocks == 1) pf.ahead = ahead;  // (past the thread's last tile: lines nobody reads, no fault)
          kRowBlocks[rows](x + m0 * ldx, ldx, panel, k0, kc, N, n0, masks, bias, k0 == 0, y + m0 * N, pf);
          m0 += rows;
        }
      }
    }
  }
  return SG_OK;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// AVX2: 16 vector registers of 8 floats. A tile's 64 columns go in four parts of 16 (2 vectors), each with
// blocks of up to 6 rows: 6 x 2 accumulators, one broadcast of x and 2 weight vectors at a time fill the
// register file, and each k row costs 8 loads for 12 FMAs (the FMA units, not the loads, set the pace). A part's
// row blocks all run over a chunk of its K rows while it is in cache (L2 at the default 1,024 rows), then over the
// next chunk.
namespace {

constexpr int kRows = 6;
constexpr int kPart = 16;
static_assert(kPart == kPacked, "the walk takes a tile's parts as sg_pack_f32 stores them");
constexpr int64_t kSlab = 96;

// Columns [c0, c0 + width) (width <= kPart) of rows [0, R) of y, over k rows [k0, k0 + kc) of this part's
// panel (`panel`: its K rows of kPart floats, sg_pack_f32). First chunk: start from bias or zero; else from y. A
// partial part (the last tile's, Full false) loads and stores through lane masks, so the accumulators never leave
// the registers; full parts use plain loads and stores (a masked store is microcoded on AMD's Zen cores: with
// masks on every part, a 1024 x 1024 layer at 32 rows took 0.72 ms, against 0.42 ms).
template <int R, bool Full>
void row_block(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t kc, int64_t N, int64_t c0,
               int width, const float* bias, bool first, float* y, Prefetch pf) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lanes);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width - 8), lanes);
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    const float* src = first ? bias : y + i * N;
    if (!src) {
      acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    } else if (Full) {
      acc[i][0] = _mm256_loadu_ps(src + c0);
      acc[i][1] = _mm256_loadu_ps(src + c0 + 8);
    } else {
      acc[i][0] = _mm256_maskload_ps(src + c0, m0);
      acc[i][1] = _mm256_maskload_ps(src + c0 + 8, m1);
    }
  }
  panel += k0 * kPart;
  x += k0;
  for (int64_t k = 0; k < kc; ++k, panel += kPart) {
    if (pf.due(k)) {
      const char* line = pf.line(k);
      for (int j = 0; j < pf.per; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
    }
    __m256 w0 = _mm256_loadu_ps(panel), w1 = _mm256_loadu_ps(panel + 8);
    // With 4 rows or fewer, GCC folds the weight loads into every FMA (2R loads of 32 bytes a k row, where Zen's
    // load ports take 2 a cycle): that made 4-row blocks load-bound (a decode GEMM at 8 rows 1.2x slower). The
    // empty asm pins them in registers.
    if (R <= 4) __asm__("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    if (Full) {
      _mm256_storeu_ps(y + i * N + c0, acc[i][0]);
      _mm256_storeu_ps(y + i * N + c0 + 8, acc[i][1]);
    } else {
      _mm256_maskstore_ps(y + i * N + c0, m0, acc[i][0]);
      _mm256_maskstore_ps(y + i * N + c0 + 8, m1, acc[i][1]);
    }
  }
}

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int,
                            const float*, bool, float*, Prefetch);
constexpr RowBlockFn kRowBlocks[2][kRows + 1] = {
    {nullptr, row_block<1, false>, row_block<2, false>, row_block<3, false>, row_block<4, false>,
     row_block<5, false>, row_block<6, false>},
    {nullptr, row_block<1, true>, row_block<2, true>, row_block<3, true>, row_block<4, true>, row_block<5, true>,
     row_block<6, true>}};

}  // namespace

extern "C" int sg_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                           const float* bias, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K) return SG_ERR_SHAPE;
  const int64_t tiles = (N + SG_TILE - 1) / SG_TILE, chunk = sg_chunk_rows(0);
  for (int64_t s0 = 0; s0 < M; s0 += kSlab) {
    const int64_t s1 = M - s0 < kSlab ? M : s0 + kSlab;
    // Claimed one at a time from per-thread ranges (claimed_ranges.h), not static: each thread still walks
    // adjacent tiles, but one that another process preempted (on a 2-core machine: Triton's responder,
    // tritonserver, a client) holds back the call's end by one tile. Large model, step GEMMs beside a process
    // that wakes every 2 ms for 0.2 ms: 32 rows 86-135 ms static, 86-87 guided (whose first claim is half the
    // tiles); its layers at 32 rows, mean of 400 calls, 2-5% shorter claimed than guided; quiet, the same.
    inflight::ClaimedRanges work(tiles, omp_get_max_threads());
#pragma omp parallel if (inflight::worth_threads((s1 - s0) * K * N))
    for (int64_t t; (t = work.next(omp_get_thread_num())) >= 0;) {
      const float* panel = packed + t * K * SG_TILE;
      const RowSplit split(s1 - s0, kRows);
      const int64_t left = (N - t * SG_TILE + kPart - 1) / kPart;  // parts of this tile holding columns
      const int parts = (int)(left < SG_TILE / kPart ? left : SG_TILE / kPart);
      for (int part = 0; part < parts; ++part) {
        const int64_t c0 = t * SG_TILE + part * kPart;
        const int width = N - c0 >= kPart ? kPart : (int)(N - c0);
        const float* rows_p = panel + part * K * kPart;  // this part's K rows, contiguous
        for (int64_t k0 = 0; k0 < K; k0 += chunk) {
          const int64_t kc = K - k0 < chunk ? K - k0 : chunk;
          // As the AVX-512 walk, weights walked later are fetched into L2 over this chunk's row block passes, as
          // far ahead in bytes: the part-by-part walk reads the panels in memory order (this part's rows, the
          // next part's, the next tile's), so that is a chunk of rows (16 floats each) starting three chunks
          // past this one's end. (With 128-row chunks, fetching the next chunk, a quarter as far ahead, made the
          // large model's decode steps at 8 rows, which stream the weights, 1.06-1.11x longer; from 3 chunks
          // past, the same as before.)
          const int64_t lead = (SG_TILE / kPart - 1) * chunk;
          const int64_t from = t * K * SG_TILE + (part * K + k0 + kc + lead) * kPart, end = tiles * K * SG_TILE;
          const int64_t ahead = from < end ? ((end - from) / kPart < chunk ? (end - from) / kPart : chunk) : 0;
          const NextChunk next(packed + (from < end ? from : 0), ahead, kPart, split.blocks, kc);
          for (int64_t b = 0, m0 = s0; b < split.blocks; ++b) {
            const int rows = split.rows(b);
            kRowBlocks[width == kPart][rows](x + m0 * ldx, ldx, rows_p, k0, kc, N, c0, width, bias, k0 == 0,
                                             y + m0 * N, next.pass(b, kc));
            m0 += rows;
          }
        }
      }
    }
  }
  return SG_OK;
}

#else

extern "C" int sg_gemm_f32(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*) {
  return SG_ERR_UNSUPPORTED;
}

#endif
