// bf16 weight panels and the AVX512-BF16 walk over them, shared by the greedy screen (greedy_screen_cpu.cpp) and
// the bf16 GEMM (bf16_gemm_cpu.cpp).
//
// The panels mirror the skinny GEMM's: per tile of kTile = 64 columns, ceil(K/2) pair rows of 64 columns x 2 bf16
// (256 bytes, like one fp32 k row), so that one 64-byte load is 16 columns' (w[2p][n], w[2p+1][n]) pairs, the
// operand VDPBF16PS multiplies with a broadcast (x[2p], x[2p+1]) pair. Row blocks of up to 6 rows keep 6 x 4 fp32
// accumulators in registers over all of a tile's pair rows while its panel, 128 KB at K = 1,024, stays in L2; the
// next tile's panel is fetched into L2 meanwhile, its lines spread over every pass (a single pass instead fetches
// `ahead` bytes past its loads: sg_stream_ahead). Each output is one chain of VDPBF16PS over the pairs in order.
#pragma once
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "claimed_ranges.h"
#include "parallel_work.h"
#include "row_split.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define GS_BUILD 1
#include <immintrin.h>
#define GS_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define GS_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace inflight::bf16 {

constexpr int64_t kTile = 64;
constexpr int kRows = 6;
constexpr int64_t kSlab = 96;  // rows of x per pass over all tiles (as the skinny GEMM's: they stay in L2)
// Where the panels exceed kHeldBytes (so each slab reads them from memory again), slabs as long as fit in
// kSlabBytes beside a tile's panel in L2 (K = 1,024: 318 rows, K = 2,752: 114): 0.96-0.98x the time at 256-2,048
// rows on the Zen 4 EPYC, weights from memory. Smaller panels stay in L2 across kSlab slabs, and longer slabs
// would evict them (K x N = 1,024 x 256 at 2,048 rows: 1.12x the time).
constexpr int64_t kSlabBytes = 640 << 10, kHeldBytes = 1 << 20;

inline int64_t pairs(int64_t K) { return (K + 1) / 2; }
inline int64_t packed_size(int64_t K, int64_t N) { return (N + kTile - 1) / kTile * pairs(K) * 2 * kTile; }

// Round to nearest even, as bf16 bits (NaN stays NaN; denormals round like any other value).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return (uint16_t)(b >> 16);
}

// The panels of a (K, N) weight: packed[(t P + p) 2 kTile + 2 c + e] = value(k, n) for k = 2p + e < K and
// n = t kTile + c < N, zero past either edge (P = pairs(K)); `value` gives bf16 bits.
template <typename Value>
void pack_panels(int64_t K, int64_t N, uint16_t* packed, Value value) {
  const int64_t P = pairs(K), tiles = (N + kTile - 1) / kTile;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t c = 0; c < kTile; ++c)
        for (int e = 0; e < 2; ++e) {
          const int64_t n = t * kTile + c, k = 2 * p + e;
          packed[(t * P + p) * 2 * kTile + 2 * c + e] = n < N && k < K ? value(k, n) : 0;
        }
}

#ifdef GS_BUILD

// Where the walk's results go: fp32 (the screen's logits) or bf16 rounded to nearest even (a bf16 model's
// activations, as torch rounds its GEMMs' fp32 sums).
GS_TARGET inline void store(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }
GS_TARGET inline void store(uint16_t* y, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows [0, R) of y (row stride N), tile at column n0: (bias or 0) + x's bf16 pairs (row stride ldp) . the
// panel's, over all P pair rows; prefetching `lines` cache lines from `next` at `per` lines a pair row from line
// `first` of this pass on, or, where `ahead` > 0, the pair row `ahead` bytes past each one loaded.
template <int R, typename Out>
GS_TARGET void row_block(const uint32_t* xp, int64_t ldp, int64_t P, const uint16_t* panel, int64_t N, int64_t n0,
                         const float* bias, Out* y, const char* next, int64_t first, int64_t lines, int per,
                         int64_t ahead) {
  __mmask16 masks[4];
  __m512 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    const int64_t left = N - n0 - 16 * j;
    masks[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    const __m512 init = bias ? _mm512_maskz_loadu_ps(masks[j], bias + n0 + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) acc[i][j] = init;
  }
  for (int64_t p = 0; p < P; ++p, panel += 2 * kTile) {
    if (ahead > 0) {
      const char* line = reinterpret_cast<const char*>(panel) + ahead;
      for (int j = 0; j < 4; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
    } else if (first < lines) {
      for (int j = 0; j < per; ++j) _mm_prefetch(next + 64 * (first + j), _MM_HINT_T1);
      first += per;
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel), w1 = (__m512bh)_mm512_loadu_si512(panel + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(panel + 64), w3 = (__m512bh)_mm512_loadu_si512(panel + 96);
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[i * ldp + p]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], w2, xv);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], w3, xv);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < R; ++i) store(y + i * N + n0 + 16 * j, masks[j], acc[i][j]);
}

// y (M, N contiguous) = (bias or 0) + x . w for x's bf16 pairs (M rows of P, row stride ldp) and w's panels:
// slabs of rows (kSlab, kSlabBytes), each over every tile (claimed_ranges.h), each tile's row blocks over its
// whole panel.
// `ahead`: sg_stream_ahead's distance, taken where a slab is one row block.
template <typename Out>
GS_TARGET void walk(const uint32_t* xp, int64_t ldp, int64_t M, int64_t P, const uint16_t* packed, int64_t N,
                    const float* bias, Out* y, int64_t ahead) {
  using Fn = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const float*, Out*,
                      const char*, int64_t, int64_t, int, int64_t);
  static constexpr Fn kBlocks[kRows + 1] = {nullptr, row_block<1, Out>, row_block<2, Out>, row_block<3, Out>,
                                            row_block<4, Out>, row_block<5, Out>, row_block<6, Out>};
  const int64_t tiles = (N + kTile - 1) / kTile, panel_values = P * 2 * kTile, lines = panel_values * 2 / 64;
  const int64_t fit = kSlabBytes / (P * 4) / kRows * kRows;
  const int64_t slab = fit > kSlab && tiles * panel_values * 2 > kHeldBytes ? fit : kSlab;
  for (int64_t s0 = 0; s0 < M; s0 += slab) {
    const int64_t slab_rows = M - s0 < slab ? M - s0 : slab;
    const RowSplit split(slab_rows, kRows);
    const int64_t blocks = split.blocks, stream = blocks == 1 ? ahead : 0;
    const int per = (int)((lines + blocks * P - 1) / (blocks * P));
    ClaimedRanges work(tiles, omp_get_max_threads());
#pragma omp parallel if (worth_threads(slab_rows * P * 2 * N))
    for (int64_t t; (t = work.next(omp_get_thread_num())) >= 0;) {
      const uint16_t* panel = packed + t * panel_values;
      const char* next = t + 1 < tiles ? reinterpret_cast<const char*>(panel + panel_values) : nullptr;
      for (int64_t b = 0, m0 = s0; b < blocks; ++b) {
        const int rows = split.rows(b);
        kBlocks[rows](xp + m0 * ldp, ldp, P, panel, N, t * kTile, bias, y + m0 * N, next, b * P * per,
                      next ? lines : 0, per, stream);
        m0 += rows;
      }
    }
  }
}

#endif  // GS_BUILD

}  // namespace inflight::bf16
