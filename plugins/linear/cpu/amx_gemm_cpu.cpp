// AMX GEMM with fp32 accuracy (see include/amx_gemm.h).
//
// Blocks of 32 rows of x by 32 columns of w, held in four 16 x 16 fp32 accumulator tiles (tmm0-3) while two
// tiles of x pieces (tmm4-5) and two of w pieces (tmm6-7) stream through: per k block of 32, the six piece
// products in an order that reloads 14 tiles for 24 tile products. The k dimension is walked in equal chunks of
// at most 32 k blocks (K <= 1,024 in one), whose x and w pieces stay in L2; partial sums live in y between chunks.
// Each pair of 32 columns is read from memory once per 192 rows of x; while its row blocks run, the next pair's
// pieces are prefetched into L2, a few lines between tile products (without it, at ~150 rows the tile loads
// waited on memory and ran no faster than the skinny GEMM; issued in bursts, the prefetches themselves stalled),
// and so are the lines of y the next block will store (and load): a tile store or load that misses stalls the
// tile unit. Tile rows are 64-byte aligned: x's pieces are placed so (a tile row across two cache lines made
// the products 1.8-2.5x slower), and the packed weight is a 64-byte aligned allocation (torch's).
#include "amx_gemm.h"

#include <string.h>

#include <vector>

#include "skinny_gemm.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define SG_AMX_BUILD 1
#endif

namespace {

constexpr int64_t kK = 32;           // bf16 values in a tile row (64 bytes); k rows of w per k block
constexpr int64_t kBlock = 32;       // rows of x, and columns of w, per block
constexpr int64_t kTile = 512;       // bf16 values in one 16 x 32 tile
constexpr int64_t kBlockTiles = 6;   // 3 pieces x 2 tiles: one block's pieces at one k block, 6 KB
constexpr int64_t kChunkKB = 32;     // most k blocks per chunk (1,024 k rows): a block's x and w pieces, 192 KB each
constexpr int64_t kChunkMB = 6;      // row blocks per pass over the weight: 192 rows, <= 1.1 MB of x pieces in L2
constexpr int64_t kBlockLines = 64;  // cache lines of one 32 x 32 fp32 block of y

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <typename T>
T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// fp32 -> bf16 bits, rounded to nearest even (finite values), and back.
[[maybe_unused]] inline uint16_t to_bf16(float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return (uint16_t)(b >> 16);
}
[[maybe_unused]] inline float from_bf16(uint16_t h) {
  const uint32_t b = (uint32_t)h << 16;
  float v;
  memcpy(&v, &b, 4);
  return v;
}

}  // namespace

extern "C" int sg_amx_min_rows(void) { return SG_AMX_MIN_ROWS; }

extern "C" int64_t sg_amx_packed_size(int64_t K, int64_t N) { return 3 * round_up(K, kK) * round_up(N, kBlock); }

#if SG_AMX_BUILD
#include <cpuid.h>
// GCC 12's _mm512_undefined_epi32 (`__m512i __Y = __Y;`) reads as uninitialized once inlined into OpenMP bodies.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SG_AMX_TARGET __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;  // every tile 16 rows of 64 bytes
  }
};

// x's fp32 rounded to bf16, as fp32 bit patterns (low 16 bits zero).
SG_AMX_TARGET inline __m512i round_bf16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u));
}

// The mask of a 16-lane vector's first n lanes (n may be <= 0 or > 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// Split 32 floats (v0, then v1) into their hi, mid and lo bf16 pieces: one 64-byte tile row each.
SG_AMX_TARGET inline void split32(__m512 v0, __m512 v1, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  // The upper 16 bits of each of v0's 16 lanes, then of v1's.
  const __m512i upper = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  uint16_t* out[3] = {hi, mid, lo};
  for (int p = 0; p < 3; ++p) {
    const __m512i r0 = round_bf16(v0), r1 = round_bf16(v1);
    _mm512_storeu_si512(out[p], _mm512_permutex2var_epi16(r0, upper, r1));
    v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(r0));
    v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(r1));
  }
}

// x (M, K) -> its pieces, laid out [row block][k block][piece][16-row tile][16][32], rows past M and k past K zero.
// One (row block, k block) at a time, so each task writes its 6 KB in order (row by row, across all k blocks, it
// wrote each line in pieces far apart: 1.3-2.6x slower).
SG_AMX_TARGET void split_x(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t Mp, int64_t KB,
                           uint16_t* pieces) {
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < Mp / kBlock * KB; ++task) {
    const int64_t mb = task / KB, k = task % KB * kK, left = K - k;
    const __mmask16 m0 = first_lanes(left), m1 = first_lanes(left - 16);
    uint16_t* dst = pieces + task * kBlockTiles * kTile;
    for (int64_t r = 0; r < kBlock; ++r) {
      const int64_t row = mb * kBlock + r;
      __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
      if (row < M) {
        v0 = _mm512_maskz_loadu_ps(m0, x + row * ldx + k);
        v1 = _mm512_maskz_loadu_ps(m1, x + row * ldx + k + 16);
      }
      uint16_t* d = dst + (r / 16) * kTile + (r % 16) * kK;
      split32(v0, v1, d, d + 2 * kTile, d + 4 * kTile);
    }
  }
}

// tmm0-3 += the six piece products of one block over `kbs` k blocks. a, b: the block's x and w pieces at its
// first k block (tile (piece, t) at (2 * piece + t) * kTile). Between products: `per_group` lines from pf into
// L2, and one line of the next block of y (rows `ystride` bytes apart; none when yn is null) into L1 for writing.
SG_AMX_TARGET inline void block_products(const uint16_t* a, const uint16_t* b, int64_t kbs, const char* pf,
                                         int per_group, const char* yn, int64_t ystride) {
  int yl = yn ? 0 : (int)kBlockLines;
  for (int64_t kb = 0; kb < kbs; ++kb, a += kBlockTiles * kTile, b += kBlockTiles * kTile) {
#define SG_DP4()                                                                  \
  _tile_dpbf16ps(0, 4, 6);                                                        \
  _tile_dpbf16ps(1, 4, 7);                                                        \
  for (int l = 0; l < per_group; ++l, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);    \
  if (yl < kBlockLines) __builtin_prefetch(yn + (yl >> 1) * ystride + (yl & 1) * 64, 1, 3), ++yl;  \
  _tile_dpbf16ps(2, 5, 6);                                                        \
  _tile_dpbf16ps(3, 5, 7)
    _tile_loadd(4, a, 64);  // x hi
    _tile_loadd(5, a + kTile, 64);
    _tile_loadd(6, b, 64);  // w hi
    _tile_loadd(7, b + kTile, 64);
    SG_DP4();
    _tile_loadd(6, b + 4 * kTile, 64);  // w lo
    _tile_loadd(7, b + 5 * kTile, 64);
    SG_DP4();
    _tile_loadd(6, b + 2 * kTile, 64);  // w mid
    _tile_loadd(7, b + 3 * kTile, 64);
    SG_DP4();
    _tile_loadd(4, a + 2 * kTile, 64);  // x mid (x mid * w mid)
    _tile_loadd(5, a + 3 * kTile, 64);
    SG_DP4();
    _tile_loadd(6, b, 64);  // w hi again (x mid * w hi)
    _tile_loadd(7, b + kTile, 64);
    SG_DP4();
    _tile_loadd(4, a + 4 * kTile, 64);  // x lo (x lo * w hi)
    _tile_loadd(5, a + 5 * kTile, 64);
    SG_DP4();
#undef SG_DP4
  }
}

SG_AMX_TARGET inline void load_acc(const float* c, int64_t ldc) {
  const int64_t stride = ldc * (int64_t)sizeof(float);
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16, stride);
  _tile_loadd(2, c + 16 * ldc, stride);
  _tile_loadd(3, c + 16 * ldc + 16, stride);
}

SG_AMX_TARGET inline void store_acc(float* c, int64_t ldc) {
  const int64_t stride = ldc * (int64_t)sizeof(float);
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 16 * ldc, stride);
  _tile_stored(3, c + 16 * ldc + 16, stride);
}

// y's block (rows x cols, at most 32 x 32) = the block's sums c (+ bias); c may be y itself.
SG_AMX_TARGET inline void finish(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias,
                                 float* y, int64_t ldy) {
  rows = rows < kBlock ? rows : kBlock;
  cols = cols < kBlock ? cols : kBlock;
  const __mmask16 masks[2] = {first_lanes(cols), first_lanes(cols - 16)};
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m512 b = bias ? _mm512_maskz_loadu_ps(masks[h], bias + 16 * h) : _mm512_setzero_ps();
      const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(masks[h], c + r * ldc + 16 * h), b);
      _mm512_mask_storeu_ps(y + r * ldy + 16 * h, masks[h], v);
    }
}

// The weight's pieces, laid out [column pair of 32][k block][piece][16-column tile][16 k pairs][16 columns][2].
void pack_w(const float* w, int64_t K, int64_t N, uint16_t* packed) {
  const int64_t KB = round_up(K, kK) / kK, pairs = round_up(N, kBlock) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t pair = 0; pair < pairs; ++pair)
    for (int64_t kb = 0; kb < KB; ++kb)
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t kp = 0; kp < 16; ++kp)
          for (int64_t n = 0; n < 16; ++n)
            for (int64_t e = 0; e < 2; ++e) {
              const int64_t k = kb * kK + 2 * kp + e, col = pair * kBlock + 16 * t + n;
              float v = k < K && col < N ? w[k * N + col] : 0.0f;
              for (int64_t p = 0; p < 3; ++p) {
                const uint16_t h = to_bf16(v);
                packed[((pair * KB + kb) * kBlockTiles + 2 * p + t) * kTile + kp * 32 + 2 * n + e] = h;
                v -= from_bf16(h);
              }
            }
}

}  // namespace

extern "C" int sg_amx_available(void) {
  static const int available = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const bool avx512 = (b >> 16) & 1u, avx512bw = (b >> 30) & 1u, amx_bf16 = (d >> 22) & 1u,
               amx_tile = (d >> 24) & 1u;
    if (!(avx512 && avx512bw && amx_bf16 && amx_tile)) return 0;
    const long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
  }();
  return available;
}

extern "C" int sg_amx_pack_f32(const float* w, int64_t K, int64_t N, uint16_t* packed) {
  if (K <= 0 || N <= 0) return SG_ERR_SHAPE;
  if (!sg_amx_available()) return SG_ERR_UNSUPPORTED;
  pack_w(w, K, N, packed);
  return SG_OK;
}

extern "C" SG_AMX_TARGET int sg_amx_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx,
                                             const uint16_t* packed, int64_t N, const float* bias, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K) return SG_ERR_SHAPE;
  if (!sg_amx_available()) return SG_ERR_UNSUPPORTED;
  if (M == 0) return SG_OK;
  const int64_t KB = round_up(K, kK) / kK, Mp = round_up(M, kBlock), mbs = Mp / kBlock;
  const int64_t pairs = round_up(N, kBlock) / kBlock;
  // Per calling thread, kept between calls: x's pieces, and the accumulators of blocks that overhang y (the last
  // row block, one per column pair; the last column pair, one per row block).
  thread_local std::vector<uint16_t> pieces;
  thread_local std::vector<float> overhang;
  const bool rows_over = Mp != M, cols_over = pairs * kBlock != N;
  pieces.resize(Mp * KB * kK * 3 + 32);  // + room to start at a 64-byte boundary
  overhang.resize(((rows_over ? pairs : 0) + (cols_over ? mbs : 0)) * kBlock * kBlock + 16);
  uint16_t* xp = align64(pieces.data());
  float* over = align64(overhang.data());
  split_x(x, M, K, ldx, Mp, KB, xp);
  const int64_t chunks = (KB + kChunkKB - 1) / kChunkKB, chunk = (KB + chunks - 1) / chunks;
#pragma omp parallel
  {
    const TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t k0 = 0; k0 < KB; k0 += chunk) {
      const int64_t kbs = KB - k0 < chunk ? KB - k0 : chunk;
      const bool first = k0 == 0, last = k0 + kbs == KB;
      for (int64_t mb0 = 0; mb0 < mbs; mb0 += kChunkMB) {
        const int64_t mb1 = mbs - mb0 < kChunkMB ? mbs : mb0 + kChunkMB;
        // Static and the same count every time: a block is always summed by the same thread, so no barrier.
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < pairs; ++pair) {
          for (int64_t mb = mb0; mb < mb1; ++mb) {
            const int64_t m0 = mb * kBlock, n0 = pair * kBlock;
            const bool row_edge = rows_over && mb == mbs - 1, col_edge = cols_over && pair == pairs - 1;
            float* c = y + m0 * N + n0;
            int64_t ldc = N;
            if (row_edge || col_edge) {
              c = over + (row_edge ? pair : (rows_over ? pairs : 0) + mb) * kBlock * kBlock;
              ldc = kBlock;
            }
            if (first) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              load_acc(c, ldc);
            }
            // The block after this one (the next row block, or the next pair's first), when it is y's own.
            const int64_t nmb = mb + 1 < mb1 ? mb + 1 : mb0, npair = mb + 1 < mb1 ? pair : pair + 1;
            const bool next_in_y =
                npair < pairs && !(rows_over && nmb == mbs - 1) && !(cols_over && npair == pairs - 1);
            const char* ynext = next_in_y ? reinterpret_cast<const char*>(y + nmb * kBlock * N + npair * kBlock)
                                          : nullptr;
            // The next pair's pieces for this chunk, spread over this pair's blocks and their k blocks.
            const int64_t lines = kbs * kBlockTiles * kTile * 2 / 64, slots = (mb1 - mb0) * kbs * 6;
            const int per_group = pair + 1 < pairs ? (int)((lines + slots - 1) / slots) : 0;
            const char* next = reinterpret_cast<const char*>(packed + ((pair + 1) * KB + k0) * kBlockTiles * kTile);
            block_products(xp + (mb * KB + k0) * kBlockTiles * kTile,
                           packed + (pair * KB + k0) * kBlockTiles * kTile, kbs,
                           next + (mb - mb0) * kbs * 6 * per_group * 64, per_group, ynext, N * (int64_t)sizeof(float));
            store_acc(c, ldc);
            if (last && (bias || c != y + m0 * N + n0)) finish(c, ldc, M - m0, N - n0, bias ? bias + n0 : nullptr,
                                                              y + m0 * N + n0, N);
          }
        }
      }
    }
    _tile_release();
  }
  return SG_OK;
}

#else  // no AMX in this compiler: callers keep sg_gemm_f32

extern "C" int sg_amx_available(void) { return 0; }
extern "C" int sg_amx_pack_f32(const float*, int64_t, int64_t, uint16_t*) { return SG_ERR_UNSUPPORTED; }
extern "C" int sg_amx_gemm_f32(const float*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                               float*) {
  return SG_ERR_UNSUPPORTED;
}

#endif
