// Paged attention on the CPU: walks each sequence's block table directly (no gather copies). Work is split into
// tasks of (sequence, KV head, block of queries), or whole one-block sequences when they are small (a decode's KV
// heads then scored chunk by chunk together, in one pass over its cache), so K and V rows are read once for every
// query head of the group; an online softmax in fp32 rescales once per chunk of
// keys. Each K/V row read serves every (query, head) row of a block; causal limits (and a sliding window's first
// keys) mask per row, and chunks wholly before every row's window are not read. Blocks of at
// least kMinTiledRows rows score a chunk of keys as a small GEMM (the chunk transposed once, keys along the
// vector lanes, four rows per register tile) instead of one horizontal dot per (row, key). In bf16, where the
// processor has AVX512-BF16, scores and V sums (decodes and prompt blocks alike) are bf16 dot products.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fast_exp.h"
#include "parallel_work.h"
#include "paged_attention.h"

namespace {

constexpr int kChunk = 64;  // keys scored before one softmax rescale

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename T> T from_float(float f);
template <> float from_float<float>(float f) { return f; }
template <> bf16 from_float<bf16>(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

// A row of head_size values as floats: the row itself for fp32, a converted copy for bf16.
inline const float* as_floats(const float* row, float*, int) { return row; }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on the intrinsics' own undefined passthroughs
inline const float* as_floats(const bf16* row, float* buf, int n) {
  int d = 0;  // bf16 is fp32's high half: widen to 32 bits, shift up
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
    _mm512_storeu_ps(buf + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#elif defined(__AVX2__)
  for (; d + 8 <= n; d += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    _mm256_storeu_ps(buf + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; d < n; ++d) buf[d] = to_float(row[d]);
  return buf;
}
#pragma GCC diagnostic pop

// Four independent 8-wide accumulators: one would serialise on the FMA latency.
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[4][8] = {};
  int d = 0;
  for (; d + 32 <= n; d += 32)
    for (int u = 0; u < 4; ++u)
#pragma omp simd
      for (int w = 0; w < 8; ++w) acc[u][w] += a[d + 8 * u + w] * b[d + 8 * u + w];
  for (int w = 0; w < 8; ++w) acc[0][w] += (acc[1][w] + acc[2][w]) + acc[3][w];
  for (int width = 4; width > 0; width /= 2)  // a tree, not a serial chain of scalar adds
    for (int w = 0; w < width; ++w) acc[0][w] += acc[0][w + width];
  float s = acc[0][0];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

using inflight::exp_neg;

// A decode reads each key's K and V rows from memory once, and with the rows scattered over blocks the hardware
// prefetcher does not run ahead of it: each row's lines were fetched as the loop reached them, ~10 GB/s a core
// (a 2,048-key decode batch from memory: 2.1x the copy floor). Rows kAhead keys ahead are asked for while the
// current ones are summed (24: large-model heads, 8 layers' caches, new / old 0.78-0.83 at batch 8-32; 8, 16 and
// 32 keys ahead 0.86-0.93, 0.82-0.87, 0.82-0.88). And the whole next chunk, every head's K and V rows, into L2
// (`Ahead`), a few rows at every step of this chunk's passes, so the memory streams the whole time the arithmetic
// runs: on the Zen 4 EPYC the loads had not overlapped it (time from memory about the sum of the time in cache and
// of the read), and with the first 24 keys of the next chunk asked for at once at a chunk's start instead, decodes
// from memory ran 1.3-1.5x longer at batch 4-32 x 2,048 keys and batch 32 x 512.
constexpr int kAhead = 24;
template <int level, typename T> inline void prefetch_rows(const T* const* rows, int n, int64_t offset, int D) {
  for (int i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(rows[i] + offset);
    for (int b = 0; b < D * int(sizeof(T)); b += 64) __builtin_prefetch(row + b, 0, level);
  }
}

template <typename T>
struct Ahead {  // the next chunk's rows (one KV head: `offset`), fetched into L2 a few at a time as this one is used
  const T* const* rows = nullptr;
  int n = 0;
  int64_t offset = 0;
};

template <typename T>
struct Seq {  // one sequence's view of the cache for one KV head
  const T* cache;
  const int32_t* table;
  const pa_params* p;
  int kv_head;
  // Row pointers of positions [start, start + n), walking the block table without a division per row.
  void rows(int start, int n, const T** out) const {
    int block = start / p->block_size, offset = start % p->block_size;
    const T* base = cache + int64_t(table[block]) * p->kv_stride_block + int64_t(kv_head) * p->kv_stride_head;
    for (int i = 0; i < n; ++i) {
      out[i] = base + int64_t(offset) * p->kv_stride_token;
      if (++offset == p->block_size && i + 1 < n) {
        offset = 0;
        base = cache + int64_t(table[++block]) * p->kv_stride_block + int64_t(kv_head) * p->kv_stride_head;
      }
    }
  }
};

// Full 512-bit vectors for the compute-bound parts (the prefill tiles, the 16-key dot products) where the
// machine has them; GCC's default tuning prefers 256-bit ones, which suits the rest better.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define PA_WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define PA_WIDE
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
constexpr bool kHaveDots = true;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on the intrinsics' own undefined passthroughs

// out[j] = sum of the 16 lanes of a[j], j < 16, in one vector: a transpose-and-add tree (45 shuffles and adds
// for 16 sums, where reducing each vector on its own takes ~6 dependent steps apiece).
inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per lane: the lane's sum for each of 4 vectors
    c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // lanes summed in pairs
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 keys' values as fp32: an fp32 row's as they are, a bf16 row's widened in registers (its bits are fp32's high
// half), so bf16 keys are scored by the same code with no widened copy.
PA_WIDE inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PA_WIDE inline __m512 load16(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
constexpr bool kBf16Dots = true;

// Four rows' products with four keys (16 sums in registers), D / 16 vectors each, reduced together (sum16):
// each K vector is loaded once for the four rows. scores[r * kChunk + j] for r, j < 4.
template <typename T>
PA_WIDE inline void dots_4x4(const float* q, const T* const* krows, int D, float* scores) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    const __m512 k0 = load16(krows[0] + d), k1 = load16(krows[1] + d), k2 = load16(krows[2] + d),
                 k3 = load16(krows[3] + d);
    for (int r = 0; r < 4; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * D + d);
      acc[4 * r] = _mm512_fmadd_ps(qv, k0, acc[4 * r]);
      acc[4 * r + 1] = _mm512_fmadd_ps(qv, k1, acc[4 * r + 1]);
      acc[4 * r + 2] = _mm512_fmadd_ps(qv, k2, acc[4 * r + 2]);
      acc[4 * r + 3] = _mm512_fmadd_ps(qv, k3, acc[4 * r + 3]);
    }
  }
  const __m512 sums = sum16(acc);  // lane 4r + j: row r, key j
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(scores + r * kChunk, _mm512_extractf32x4_ps(sums, r));
}

// scores[g * kChunk + i] = q[g] . k_i for the n keys of a chunk, 16 keys per pass: whole passes in 4 x 4 blocks
// of rows and keys (dots_4x4), other rows one at a time, each key's products summed across its D / 16 vectors in
// registers, then the 16 keys' vectors reduced together (sum16). D is a multiple of 16; keys past n (a partial
// last pass) are not read. (A pass's sums are in registers only where the compiler sees 16 of them: with the
// pass's key count as the loop's bound, they lived on the stack, a load and a store around every FMA.)
template <typename T>
PA_WIDE void dots(const float* q, const T* const* krows, int n, int rows, int D, float* scores, Ahead<T> next = {}) {
  for (int i0 = 0; i0 < n; i0 += 16) {
    const int m = std::min(16, n - i0);
    if (i0 + kAhead < n) prefetch_rows<3>(krows + i0 + kAhead, std::min(16, n - i0 - kAhead), 0, D);
    if (i0 < next.n) prefetch_rows<2>(next.rows + i0, std::min(16, next.n - i0), next.offset, D);
    int g = 0;
    if (m == 16)
      for (; g + 4 <= rows; g += 4)
        for (int j = 0; j < 16; j += 4) dots_4x4(q + g * D, krows + i0 + j, D, scores + g * kChunk + i0 + j);
    for (; g < rows; ++g) {
      const float* qg = q + g * D;
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      if (m == 16) {
        for (int d = 0; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qg + d);
          for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(krows[i0 + j] + d), acc[j]);
        }
      } else {
        for (int d = 0; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qg + d);
          for (int j = 0; j < m; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(krows[i0 + j] + d), acc[j]);
        }
      }
      const __m512 sums = sum16(acc);
      _mm512_mask_storeu_ps(scores + g * kChunk + i0, (__mmask16)((1u << m) - 1), sums);
    }
  }
}
#pragma GCC diagnostic pop
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
constexpr bool kHaveDots = true;
constexpr bool kBf16Dots = false;  // bf16 keys are widened into a copy first (attend)

// out[j] = sum of the 8 lanes of a[j], j < 8: pairwise horizontal adds, then the two 128-bit halves.
inline __m256 sum8(const __m256* a) {
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // a0..a3, per half
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // a4..a7, per half
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// As the AVX-512 dots (D a multiple of 16), 8 keys per pass with 8-wide vectors; the last n % 8 keys through
// dot(). Full passes only, so the accumulators stay in registers.
inline void dots(const float* q, const float* const* krows, int n, int rows, int D, float* scores,
                 Ahead<float> next = {}) {
  int i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    if (i0 + kAhead < n) prefetch_rows<3>(krows + i0 + kAhead, std::min(8, n - i0 - kAhead), 0, D);
    if (i0 < next.n) prefetch_rows<2>(next.rows + i0, std::min(8, next.n - i0), next.offset, D);
    for (int g = 0; g < rows; ++g) {
      const float* qg = q + g * D;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[i0 + j] + d), acc[j]);
      }
      _mm256_storeu_ps(scores + g * kChunk + i0, sum8(acc));
    }
  }
  for (int i = i0; i < n; ++i)
    for (int g = 0; g < rows; ++g) scores[g * kChunk + i] = dot(q + g * D, krows[i], D);
}
#else
constexpr bool kHaveDots = false;
constexpr bool kBf16Dots = false;
inline void dots(const float*, const float* const*, int, int, int, float*, Ahead<float> = {}) {}
#endif

// acc[g] += sum_i scores[g][i] * v_i, head by head so one head's accumulator stays in registers.
inline void accumulate(const float* const* rows, int n, const float* scores, int group, int D, float* acc,
                       float*) {
  for (int g = 0; g < group; ++g) {
    float* __restrict a = acc + g * D;
    const float* w = scores + g * kChunk;
    int i = 0;
    for (; i + 4 <= n; i += 4) {  // four keys per pass over the accumulator: a quarter of its loads and stores
      const float *__restrict v0 = rows[i], *__restrict v1 = rows[i + 1], *__restrict v2 = rows[i + 2],
                  *__restrict v3 = rows[i + 3];
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += (w[i] * v0[d] + w[i + 1] * v1[d]) + (w[i + 2] * v2[d] + w[i + 3] * v3[d]);
    }
    for (; i < n; ++i) {
      const float* __restrict v = rows[i];
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += w[i] * v[d];
    }
  }
}
inline void accumulate(const bf16* const* rows, int n, const float* scores, int group, int D, float* acc,
                       float* buf) {
  for (int i = 0; i < n; ++i) {
    const float* v = as_floats(rows[i], buf, D);
    for (int g = 0; g < group; ++g) {
      const float w = scores[g * kChunk + i];
      float* __restrict a = acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += w * v[d];
    }
  }
}

constexpr int kMaxRows = 128;  // (query, head) rows per block: queries per block = max(1, kMaxRows / group)
constexpr int kTileRows = 4;  // rows per register tile
constexpr int kMinTiledRows = 8;  // smaller blocks (decode: one query, its group of heads) use dot()


// scores[g][i] = q[g] . k_i for all rows g and the kChunk keys of kt (D x kChunk, keys beyond the chunk zero).
#if defined(__AVX512F__)
// R rows at a time, their R x kChunk sums in R x 4 vector registers: each kt row, loaded once as 4 vectors,
// feeds 4R independent FMAs. (Written with intrinsics: the portable loop below kept its sums on the stack, a
// load and a store around every FMA.)
template <int R>
PA_WIDE inline void score_rows(const float* __restrict q, const float* __restrict kt, int D,
                               float* __restrict scores) {
  static_assert(kChunk == 64, "four 16-wide vectors per row of scores");
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const float* kd = kt + d * kChunk;
    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16), k2 = _mm512_loadu_ps(kd + 32),
                 k3 = _mm512_loadu_ps(kd + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * D + d]);
      s[r][0] = _mm512_fmadd_ps(a, k0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(a, k1, s[r][1]);
      s[r][2] = _mm512_fmadd_ps(a, k2, s[r][2]);
      s[r][3] = _mm512_fmadd_ps(a, k3, s[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(scores + r * kChunk + 16 * j, s[r][j]);
}

PA_WIDE void score_tile(const float* __restrict q, const float* __restrict kt, int rows, int D,
                        float* __restrict scores) {
  int g = 0;
  for (; g + 6 <= rows; g += 6) score_rows<6>(q + g * D, kt, D, scores + g * kChunk);
  for (; g + 2 <= rows; g += 2) score_rows<2>(q + g * D, kt, D, scores + g * kChunk);
  if (g < rows) score_rows<1>(q + g * D, kt, D, scores + g * kChunk);
}
#else
// Four rows at a time: each kt row loaded once feeds 4 x kChunk/16 independent FMA accumulators.
PA_WIDE void score_tile(const float* __restrict q, const float* __restrict kt, int rows, int D,
                       float* __restrict scores) {
  int g = 0;
  for (; g + kTileRows <= rows; g += kTileRows) {
    float s[kTileRows][kChunk] = {};
    const float *q0 = q + g * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    for (int d = 0; d < D; ++d) {
      const float* kd = kt + d * kChunk;
      const float a0 = q0[d], a1 = q1[d], a2 = q2[d], a3 = q3[d];
#pragma omp simd
      for (int i = 0; i < kChunk; ++i) {
        s[0][i] += a0 * kd[i];
        s[1][i] += a1 * kd[i];
        s[2][i] += a2 * kd[i];
        s[3][i] += a3 * kd[i];
      }
    }
    std::memcpy(scores + g * kChunk, s, sizeof s);
  }
  for (; g < rows; ++g) {
    float s[kChunk] = {};
    for (int d = 0; d < D; ++d) {
      const float a = q[g * D + d];
      const float* kd = kt + d * kChunk;
#pragma omp simd
      for (int i = 0; i < kChunk; ++i) s[i] += a * kd[i];
    }
    std::memcpy(scores + g * kChunk, s, sizeof s);
  }
}
#endif

// One row's chunk of scores s[0, n) -> e^(s - m_new), m_new = the larger of m and the chunk's largest score
// (NaN scores passed over, as std::max(m, s) does); returns m_new and the chunk's sum in *sum. A row with no
// key of its window seen yet (m_new = -inf) gets zeros.
inline float softmax_chunk(float* s, int n, float m, float* sum) {
  float m_new = m;  // a simd max: std::max_element is a scalar loop, half the cost of the scores
#pragma omp simd reduction(max : m_new)
  for (int i = 0; i < n; ++i) m_new = std::max(m_new, s[i]);
  float total = 0.f;
  if (m_new == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + n, 0.f);
  } else {
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; ++i) {
      s[i] = exp_neg(s[i] - m_new);
      total += s[i];
    }
  }
  *sum = total;
  return m_new;
}

#if defined(__AVX512F__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on the intrinsics' own undefined passthroughs
// exp_neg over 16 lanes, the same clamp and polynomial (fast_exp.h), so a lane gets what the scalar call gives.
PA_WIDE inline __m512 exp_neg16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ);
  const __m512 y = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, whole);
  __m512 r = _mm512_set1_ps(1.53552577e-4f);
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.33988708e-3f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(9.61808753e-3f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(5.55034615e-2f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(2.40226486e-1f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(6.93147182e-1f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, r, _mm512_castsi512_ps(bits));
}

// In vectors, the maximum and the sum each reduced as a tree (the vectoriser's own reductions ended in a scalar
// loop over the chunk, and in 16 dependent scalar adds: together as long as scoring the chunk). Prompt tiles and
// decodes (beside dots_4x4; with the one-row dots before it, decodes had measured 1.04-1.05x slower with it).
PA_WIDE inline float softmax_chunk16(float* s, int n, float m, float* sum) {
  static_assert(kChunk == 64, "four 16-wide vectors per row of scores");
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 v[4], top = _mm512_set1_ps(m);
  for (int j = 0; j < 4; ++j) {
    const int left = n - 16 * j;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    v[j] = _mm512_mask_loadu_ps(ninf, mask, s + 16 * j);
    top = _mm512_max_ps(v[j], top);  // a NaN in v gives top's lane
  }
  const float m_new = _mm512_reduce_max_ps(top);
  if (m_new == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + n, 0.f);
    *sum = 0.f;
    return m_new;
  }
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {  // lanes past n: e^-inf = 0, stored in the row's unused slots
    const __m512 e = exp_neg16(_mm512_sub_ps(v[j], mv));
    _mm512_storeu_ps(s + 16 * j, e);
    total = _mm512_add_ps(total, e);
  }
  *sum = _mm512_reduce_add_ps(total);
  return m_new;
}

// kt (D x kChunk) = the chunk's n key rows transposed, keys past n zero: 16 x 16 blocks transposed in registers.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // then pairs of pairs: per 128-bit lane, four rows' values of one column
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                  c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes of four rows' groups gathered
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// bf16 keys are widened in registers as they are loaded (load16).
template <typename T>
inline bool transpose_keys(const T* const* krows, int n, int D, float* kt) {
  if (D % 16) return false;
  for (int i0 = 0; i0 < kChunk; i0 += 16)
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = i0 + j < n ? load16(krows[i0 + j] + d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (d0 + c) * kChunk + i0, r[c]);
    }
  return true;
}

#if defined(__AVX512BF16__)
// bf16 by bf16 dot products (VDPBF16PS: each 32-bit lane sums two products, twice an FMA's), the queries kept as
// bf16 pairs, unscaled (qp: D/2 a row), the scores scaled after their sums.
constexpr bool kBf16Pairs = true;

// dots_4x4 for bf16: a K vector is 32 of a key's values as they lie in the cache (no widening), summed in pairs.
PA_WIDE inline void dots_4x4_pairs(const uint32_t* qp, const bf16* const* krows, int D, float scale, float* scores) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(krows[0] + d), k1 = (__m512bh)_mm512_loadu_si512(krows[1] + d),
                   k2 = (__m512bh)_mm512_loadu_si512(krows[2] + d), k3 = (__m512bh)_mm512_loadu_si512(krows[3] + d);
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + r * (D / 2) + d / 2);
      acc[4 * r] = _mm512_dpbf16_ps(acc[4 * r], qv, k0);
      acc[4 * r + 1] = _mm512_dpbf16_ps(acc[4 * r + 1], qv, k1);
      acc[4 * r + 2] = _mm512_dpbf16_ps(acc[4 * r + 2], qv, k2);
      acc[4 * r + 3] = _mm512_dpbf16_ps(acc[4 * r + 3], qv, k3);
    }
  }
  const __m512 sums = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));  // lane 4r + j: row r, key j
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(scores + r * kChunk, _mm512_extractf32x4_ps(sums, r));
}

// dots for bf16 keys by bf16 dot products (D a multiple of 32): the same passes, prefetches and reductions. (The
// passes' prefetch lines are written out in both: moved into a shared helper, GCC's code for the whole bf16 decode
// path came out 1.6-1.9x slower.)
PA_WIDE void dots_pairs(const uint32_t* qp, const bf16* const* krows, int n, int rows, int D, float scale,
                        float* scores, Ahead<bf16> next = {}) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i0 = 0; i0 < n; i0 += 16) {
    const int m = std::min(16, n - i0);
    if (i0 + kAhead < n) prefetch_rows<3>(krows + i0 + kAhead, std::min(16, n - i0 - kAhead), 0, D);
    if (i0 < next.n) prefetch_rows<2>(next.rows + i0, std::min(16, next.n - i0), next.offset, D);
    int g = 0;
    if (m == 16)
      for (; g + 4 <= rows; g += 4)
        for (int j = 0; j < 16; j += 4)
          dots_4x4_pairs(qp + g * (D / 2), krows + i0 + j, D, scale, scores + g * kChunk + i0 + j);
    for (; g < rows; ++g) {
      const uint32_t* qg = qp + g * (D / 2);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d / 2);
        if (m == 16)
          for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(krows[i0 + j] + d));
        else
          for (int j = 0; j < m; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(krows[i0 + j] + d));
      }
      _mm512_mask_storeu_ps(scores + g * kChunk + i0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
    }
  }
}

// Prompt tiles: kp (D/2 x kChunk, 32-bit lanes) = the chunk's keys as pairs, kp[p * kChunk + i] = key i's values
// 2p and 2p + 1, keys past n zero; a key row's 16 pairs are 16 32-bit lanes, so 16 x 16 blocks of them transpose
// as fp32 ones do.
inline void transpose_key_pairs(const bf16* const* krows, int n, int D, uint32_t* kp) {
  for (int i0 = 0; i0 < kChunk; i0 += 16)
    for (int p0 = 0; p0 < D / 2; p0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = i0 + j < n ? _mm512_castsi512_ps(_mm512_loadu_si512(krows[i0 + j] + 2 * p0)) : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kp + (p0 + c) * kChunk + i0, _mm512_castps_si512(r[c]));
    }
}

// scores[r][i] = scale * (q_r . k_i) for R rows of bf16 query pairs (qp, P pairs a row) and kp's kChunk keys: the
// products exact, summed in fp32 (the fp32 tiles sum (scale * q_r) . k_i).
template <int R>
PA_WIDE inline void score_rows_bf16(const uint32_t* __restrict qp, const uint32_t* __restrict kp, int P, float scale,
                                    float* __restrict scores) {
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const uint32_t* kd = kp + p * kChunk;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd), k1 = (__m512bh)_mm512_loadu_si512(kd + 16),
                   k2 = (__m512bh)_mm512_loadu_si512(kd + 32), k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(qp[r * P + p]));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], a, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], a, k1);
      s[r][2] = _mm512_dpbf16_ps(s[r][2], a, k2);
      s[r][3] = _mm512_dpbf16_ps(s[r][3], a, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(scores + r * kChunk + 16 * j, _mm512_mul_ps(s[r][j], sc));
}

PA_WIDE void score_tile_bf16(const uint32_t* qp, const uint32_t* kp, int rows, int P, float scale, float* scores) {
  int g = 0;
  for (; g + 6 <= rows; g += 6) score_rows_bf16<6>(qp + g * P, kp, P, scale, scores + g * kChunk);
  for (; g + 2 <= rows; g += 2) score_rows_bf16<2>(qp + g * P, kp, P, scale, scores + g * kChunk);
  if (g < rows) score_rows_bf16<1>(qp + g * P, kp, P, scale, scores + g * kChunk);
}

// Word indices for _mm512_permutex2var_epi16(a, i, b): a[k], b[k] for k < 16 (low), for 16 <= k < 32 (high).
inline __m512i pair_low() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35,
                          3, 34, 2, 33, 1, 32, 0);
}
inline __m512i pair_high() { return _mm512_add_epi16(pair_low(), _mm512_set1_epi16(16)); }

// The V side by bf16 dot products too, as torch's bf16 attention multiplies V by probabilities rounded to bf16:
// vp (kChunk/2 x D, 32-bit lanes) = the chunk's V rows in pairs of keys, vp[t * D + d] = values d of keys 2t and
// 2t + 1 (a key past n: zero); pp (rows x kChunk/2) = each row's probabilities, rounded to bf16, in the same pairs.
inline void pair_values(const bf16* const* vrows, int n, int D, uint32_t* vp) {
  const __m512i lo = pair_low(), hi = pair_high();
  for (int t = 0; 2 * t < n; ++t)
    for (int d0 = 0; d0 < D; d0 += 32) {
      const __m512i a = _mm512_loadu_si512(vrows[2 * t] + d0);
      const __m512i b = 2 * t + 1 < n ? _mm512_loadu_si512(vrows[2 * t + 1] + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + t * D + d0, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + t * D + d0 + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// (Keys past n get 0: their slots may hold another chunk's scores, and a pair's second key may be past n.)
inline void pair_probabilities(const float* scores, int rows, int n, uint32_t* pp) {
  static_assert(kChunk == 64, "two 32-key halves a row");
  __mmask16 masks[4];
  for (int j = 0; j < 4; ++j) {
    const int left = n - 16 * j;
    masks[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
  }
  for (int g = 0; g < rows; ++g)
    for (int h = 0; h < 2; ++h) {
      const float* s = scores + g * kChunk + 32 * h;
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(masks[2 * h + 1], s + 16),
                                             _mm512_maskz_loadu_ps(masks[2 * h], s));
      _mm512_storeu_si512(pp + g * (kChunk / 2) + 16 * h, (__m512i)v);
    }
}

// A decode's V side by bf16 dot products: acc[g] += sum_i p[g][i] * v_i over the chunk's n keys for `rows` rows
// (a head's query group), R rows a pass, each pair of V rows interleaved in registers as it is loaded (a decode's
// few rows do not repay pair_values' copy); probabilities rounded to bf16 (pp, pair_probabilities). Prefetches as
// accumulate_tile's: in the first pass, rows kAhead keys ahead (`ahead`) and the next chunk's (`next`).
template <int D, int R>
PA_WIDE void accumulate_rows_paired(const bf16* const* vrows, int n, const uint32_t* pp, float* acc, bool first,
                                    bool ahead, Ahead<bf16> next) {
  constexpr int V = D / 16;
  const __m512i lo = pair_low(), hi = pair_high();
  __m512 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
  for (int i = 0; i < n; i += 2) {
    if (first) {
      for (int k = i; k < i + 2; ++k) {
        if (ahead && k + kAhead < n) prefetch_rows<3>(vrows + k + kAhead, 1, 0, D);
        if (k < next.n) prefetch_rows<2>(next.rows + k, 1, next.offset, D);
      }
    }
    const bf16* v0 = vrows[i];
    const bf16* v1 = i + 1 < n ? vrows[i + 1] : nullptr;
    __m512bh vp[V];
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i y = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
      vp[2 * c] = (__m512bh)_mm512_permutex2var_epi16(x, lo, y);
      vp[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x, hi, y);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pp[r * (kChunk / 2) + i / 2]));
      for (int j = 0; j < V; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], w, vp[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(acc + r * D + 16 * j, a[r][j]);
}

template <int D, int R>
PA_WIDE void accumulate_paired(const bf16* const* vrows, int n, const uint32_t* pp, int rows, float* acc, bool ahead,
                               Ahead<bf16> next) {
  int g = 0;
  for (; g + R <= rows; g += R)
    accumulate_rows_paired<D, R>(vrows, n, pp + g * (kChunk / 2), acc + g * D, g == 0, ahead, next);
  for (; g < rows; ++g)
    accumulate_rows_paired<D, 1>(vrows, n, pp + g * (kChunk / 2), acc + g * D, g == 0, ahead, next);
}

// acc[g] += sum_t pp[g][t] . vp[t] over the chunk's `pairs` key pairs, R rows a pass (their R x D sums in registers).
template <int D, int R>
PA_WIDE void accumulate_pairs_rows(const uint32_t* __restrict vp, int pairs, const uint32_t* __restrict pp,
                                   float* __restrict acc) {
  constexpr int V = D / 16;
  __m512 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
  for (int t = 0; t < pairs; ++t) {
    __m512bh v[V];
    for (int j = 0; j < V; ++j) v[j] = (__m512bh)_mm512_loadu_si512(vp + t * D + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pp[r * (kChunk / 2) + t]));
      for (int j = 0; j < V; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], w, v[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(acc + r * D + 16 * j, a[r][j]);
}

template <int D, int R>
PA_WIDE void accumulate_pairs(const uint32_t* vp, int pairs, const uint32_t* pp, int rows, float* acc) {
  int g = 0;
  for (; g + R <= rows; g += R) accumulate_pairs_rows<D, R>(vp, pairs, pp + g * (kChunk / 2), acc + g * D);
  for (; g < rows; ++g) accumulate_pairs_rows<D, 1>(vp, pairs, pp + g * (kChunk / 2), acc + g * D);
}
#endif
#pragma GCC diagnostic pop
#else
inline float softmax_chunk16(float* s, int n, float m, float* sum) { return softmax_chunk(s, n, m, sum); }
template <typename T> inline bool transpose_keys(const T* const*, int, int, float*) { return false; }
#endif
#if !defined(__AVX512BF16__)
constexpr bool kBf16Pairs = false;
inline void dots_pairs(const uint32_t*, const bf16* const*, int, int, int, float, float*, Ahead<bf16> = {}) {}
inline void transpose_key_pairs(const bf16* const*, int, int, uint32_t*) {}
inline void score_tile_bf16(const uint32_t*, const uint32_t*, int, int, float, float*) {}
inline void pair_values(const bf16* const*, int, int, uint32_t*) {}
inline void pair_probabilities(const float*, int, int, uint32_t*) {}
template <int D, int R> void accumulate_pairs(const uint32_t*, int, const uint32_t*, int, float*) {}
template <int D, int R>
void accumulate_paired(const bf16* const*, int, const uint32_t*, int, float*, bool, Ahead<bf16>) {}
#endif

// acc[g] += sum_i scores[g][i] * v_i for head size D, R rows per pass so the R x D accumulator stays in
// registers while every V row is loaded once per pass.
// `ahead`: rows kAhead keys ahead are prefetched in the first pass (decodes: read from memory once).
template <int D, int R, typename T>
PA_WIDE void accumulate_tile(const T* const* vrows, int n, const float* scores, int rows, float* acc, float* buf,
                             bool ahead, Ahead<T> next = {}) {
  int g = 0;
  for (; g + R <= rows; g += R) {
    float a[R][D];
    std::memcpy(a, acc + g * D, sizeof a);
    for (int i = 0; i < n; ++i) {
      if (ahead && g == 0 && i + kAhead < n) prefetch_rows<3>(vrows + i + kAhead, 1, 0, D);
      if (g == 0 && i < next.n) prefetch_rows<2>(next.rows + i, 1, next.offset, D);
      const float* __restrict v = as_floats(vrows[i], buf, D);
      float w[R];
      for (int r = 0; r < R; ++r) w[r] = scores[(g + r) * kChunk + i];
      for (int r = 0; r < R; ++r)
#pragma omp simd
        for (int d = 0; d < D; ++d) a[r][d] += w[r] * v[d];
    }
    std::memcpy(acc + g * D, a, sizeof a);
  }
  if (g < rows) accumulate(vrows, n, scores + g * kChunk, rows - g, D, acc + g * D, buf);
}

struct Scratch {  // per-thread buffers, allocated once per call
  std::vector<float> q, acc, scores, buf, m, l, kt;
  std::vector<int> first, limit;
  std::vector<const void*> shifted;  // one chunk's row pointers moved to another KV head
  std::vector<uint32_t> qp;  // bf16 by bf16 dot products: the rows' queries, unscaled, as bf16 pairs
  std::vector<uint32_t> pp;  // and their probabilities, rounded to bf16, in pairs of keys (pair_probabilities)
  std::vector<float> wide;  // bf16 rows as fp32: a prompt's chunk of V rows, or keys the dots cannot read
  std::vector<const float*> wide_rows;
  Scratch(int rows, int D, bool tiled, bool widened, bool pairs)
      : q(rows * D), acc(rows * D), scores(rows * kChunk), buf(D), m(rows), l(rows), kt(tiled ? D * kChunk : 0),
        first(rows), limit(rows), shifted(kChunk), qp(pairs ? rows * D / 2 : 0), pp(pairs ? rows * kChunk / 2 : 0),
        wide(widened ? kChunk * D : 0), wide_rows(widened ? kChunk : 0) {}
  // rows[i] + offset for the chunk's n rows (the same positions in another KV head), valid until the next call.
  template <typename T> const T** head_rows(const T* const* rows, int n, int64_t offset) {
    const T** out = reinterpret_cast<const T**>(shifted.data());
    for (int i = 0; i < n; ++i) out[i] = rows[i] + offset;
    return out;
  }
};

// The task a thread takes after this one, when it is a single query from key 0 (a decode): its K and V, and
// its keys. Its first chunk's rows are fetched beside this task's last chunks, as a chunk's next one is: each
// task's first keys had been read cold (a decode batch's tasks are a few chunks each; batch 32 x 128-512 keys
// from memory 0.76-0.93x the time, `benchmarks/attention.py --layers 8`).
template <typename T>
struct NextTask {
  const Seq<T>* k = nullptr;
  const Seq<T>* v = nullptr;
  int n = 0;  // its keys (0: no next task to fetch)
};

// Attention of `rows` query rows (already scaled, in w.q; row r sees keys [w.first[r], w.limit[r]), both
// ascending with r) over keys [w.first[0], num_keys), num_keys = the largest limit. Row r is head r % group_size
// of token r / group_size:
// its result goes to out + (r / group_size) * out_token_stride + (r % group_size) * out_head_stride. (Per-row
// output pointers instead made the whole loop 2x slower: the compiler could no longer keep its arrays apart.)
// With heads > 1 (one decode token, untiled) the rows are `heads` KV heads' query groups, k's head first: each
// chunk of keys is scored and summed for every head before the next, so a token's K and V rows, adjacent in the
// cache, are read in one pass from memory instead of one strided pass per head.
// `tiled` (heads == 1, rows >= kMinTiledRows: a prompt's query block) scores chunks as register tiles; a
// compile-time choice, so the decode path's code is not compiled around the tiles' (1.15-1.25x slower decodes).
// `after` (untiled): the thread's next task, whose first chunk is fetched during this one's last chunks.
template <bool tiled, typename T>
void attend(const pa_params& p, int rows, int group_size, int heads, const Seq<T>& k, const Seq<T>& v,
            int num_keys, Scratch& w, T* out, int64_t out_token_stride, int64_t out_head_stride,
            NextTask<T> after = {}) {
  const int D = p.head_size, group = rows, per_head = rows / heads;
  const float* q = w.q.data();
  const int *first = w.first.data(), *limit = w.limit.data();
  const int start = first[0];
  float *acc = w.acc.data(), *scores = w.scores.data(), *buf = w.buf.data(), *m = w.m.data(), *l = w.l.data();
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.f);
  std::fill(acc, acc + group * D, 0.f);
  const T *krows[kChunk], *vrows[kChunk];
  k.rows(start, std::min(kChunk, num_keys - start), krows);
  v.rows(start, std::min(kChunk, num_keys - start), vrows);
  // Scoring by vector dots and V sums in register tiles pace the next chunk's fetches (`Ahead`); the other paths
  // ask for its first kAhead keys' rows at once.
  constexpr bool dots_take_t = std::is_same<T, float>::value || kBf16Dots;
  const bool vector_dots = kHaveDots && dots_take_t && D % 16 == 0;
  // bf16 keys without AVX-512: each head's chunk widened to fp32 once (w.wide), then the same vector dots (a row
  // at a time through dot() had made bf16 decodes 2x slower than fp32 ones, on half the bytes).
  const bool wide_dots = kHaveDots && !dots_take_t && D % 16 == 0;
  const bool v_tiles = (D == 64 && per_head >= 4) || (D == 128 && per_head >= 2);  // accumulate_tile's R rows
  int spilled = 0;  // keys of the next task asked for so far
  for (int k0 = start; k0 < num_keys; k0 += kChunk) {
    const int n = std::min(kChunk, num_keys - k0);
    // The next chunk's rows: decodes fetch them into L2 while this chunk is used; then they are this loop's next.
    const T *knext[kChunk], *vnext[kChunk];
    const int nn = k0 + n < num_keys ? std::min(kChunk, num_keys - k0 - n) : 0;
    int ahead = tiled ? 0 : nn;
    if (nn > 0) {
      k.rows(k0 + n, nn, knext);
      v.rows(k0 + n, nn, vnext);
    }
    // Near the end, the next task's first chunk joins the rows fetched beside this chunk (after its rows' n).
    if (const int extra = std::min(kChunk - nn, std::min(kChunk, after.n) - spilled); !tiled && extra > 0) {
      after.k->rows(spilled, extra, knext + nn);
      after.v->rows(spilled, extra, vnext + nn);
      ahead = nn + extra;
      spilled += extra;
    }
    if (ahead > 0 && !(vector_dots && v_tiles))
      for (int h = 0; h < heads; ++h) {
        if (!vector_dots) prefetch_rows<2>(knext, std::min(kAhead, ahead), h * p.kv_stride_head, D);
        if (!v_tiles) prefetch_rows<2>(vnext, std::min(kAhead, ahead), h * p.kv_stride_head, D);
      }
    if constexpr (tiled) {
      bool scored = false;
      if constexpr (std::is_same<T, bf16>::value)
        if (!w.qp.empty()) {  // bf16 dot products (Scratch holds query pairs only where they apply)
          uint32_t* kp = reinterpret_cast<uint32_t*>(w.kt.data());  // D x kChunk floats hold D/2 x kChunk pairs
          transpose_key_pairs(krows, n, D, kp);
          score_tile_bf16(w.qp.data(), kp, group, D / 2, p.scale, scores);
          scored = true;
        }
      if (!scored) {
        float* kt = w.kt.data();
        if (!transpose_keys(krows, n, D, kt)) {
          for (int i = 0; i < n; ++i) {
            const float* krow = as_floats(krows[i], buf, D);
            for (int d = 0; d < D; ++d) kt[d * kChunk + i] = krow[d];
          }
          if (n < kChunk)
            for (int d = 0; d < D; ++d) std::fill(kt + d * kChunk + n, kt + (d + 1) * kChunk, 0.f);
        }
        score_tile(q, kt, group, D, scores);
      }
    } else {
      for (int h = 0; h < heads; ++h) {
        const T** hk = h == 0 ? krows : w.head_rows(krows, n, h * p.kv_stride_head);
        const int g0 = h * per_head;
        if (vector_dots) {
          if constexpr (std::is_same<T, bf16>::value)
            if (!w.qp.empty()) {
              dots_pairs(w.qp.data() + g0 * (D / 2), hk, n, per_head, D, p.scale, scores + g0 * kChunk,
                         Ahead<T>{knext, ahead, h * p.kv_stride_head});
              continue;
            }
          if constexpr (dots_take_t)
            dots(q + g0 * D, hk, n, per_head, D, scores + g0 * kChunk, Ahead<T>{knext, ahead, h * p.kv_stride_head});
        } else if (wide_dots) {
          const float** rows_f = w.wide_rows.data();
          for (int i = 0; i < n; ++i) rows_f[i] = as_floats(hk[i], w.wide.data() + i * D, D);
          dots(q + g0 * D, rows_f, n, per_head, D, scores + g0 * kChunk);
        } else {
          for (int i = 0; i < n; ++i) {
            const float* krow = as_floats(hk[i], buf, D);
            for (int g = g0; g < g0 + per_head; ++g) scores[g * kChunk + i] = dot(q + g * D, krow, D);
          }
        }
      }
    }
    if (k0 + n > limit[0])  // causal mask, only in the last chunks of a query block (rows' limits ascend)
      for (int g = 0; g < group; ++g)
        for (int i = std::max(0, limit[g] - k0); i < n; ++i)
          scores[g * kChunk + i] = -std::numeric_limits<float>::infinity();
    if (k0 < first[group - 1])  // the window's start, only in the first chunks (rows' firsts ascend)
      for (int g = 0; g < group; ++g)
        for (int i = 0, e = std::min(n, first[g] - k0); i < e; ++i)
          scores[g * kChunk + i] = -std::numeric_limits<float>::infinity();
    for (int g = 0; g < group; ++g) {
      float sum;
      const float m_new = softmax_chunk16(scores + g * kChunk, n, m[g], &sum);
      if (m_new == -std::numeric_limits<float>::infinity()) continue;  // no key of this row's window seen yet
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      float* a = acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] *= alpha;
    }
    // register tiles whatever the rows: each V row loaded once per tile of rows
    auto sum_values = [&](auto hv, const float* hs, float* ha, auto next) {
      if (D == 64)
        accumulate_tile<64, 4>(hv, n, hs, per_head, ha, buf, !tiled, next);
      else if (D == 128)
        accumulate_tile<128, 2>(hv, n, hs, per_head, ha, buf, !tiled, next);
      else
        accumulate(hv, n, hs, per_head, D, ha, buf);
    };
    bool summed = false;
    if constexpr (std::is_same<T, bf16>::value) {
      if (!w.qp.empty() && (D == 64 || D == 128)) {  // bf16 dot products
        pair_probabilities(scores, group, n, w.pp.data());
        if (tiled) {  // heads == 1: the chunk's V rows interleaved once for the block's many rows
          uint32_t* vp = reinterpret_cast<uint32_t*>(w.wide.data());  // kChunk x D floats hold kChunk/2 x D pairs
          pair_values(vrows, n, D, vp);
          if (D == 64)
            accumulate_pairs<64, 6>(vp, (n + 1) / 2, w.pp.data(), group, acc);
          else
            accumulate_pairs<128, 2>(vp, (n + 1) / 2, w.pp.data(), group, acc);
        } else {
          for (int h = 0; h < heads; ++h) {
            const T** hv = h == 0 ? vrows : w.head_rows(vrows, n, h * p.kv_stride_head);
            const uint32_t* hp = w.pp.data() + h * per_head * (kChunk / 2);
            const Ahead<T> next{vnext, ahead, h * p.kv_stride_head};
            if (D == 64)
              accumulate_paired<64, 4>(hv, n, hp, per_head, acc + h * per_head * D, true, next);
            else
              accumulate_paired<128, 2>(hv, n, hp, per_head, acc + h * per_head * D, true, next);
          }
        }
        summed = true;
      } else if (tiled) {  // a prompt's bf16 V rows widened once, not once a tile
        const float** rows_f = w.wide_rows.data();
        for (int i = 0; i < n; ++i) rows_f[i] = as_floats(vrows[i], w.wide.data() + i * D, D);
        sum_values(rows_f, scores, acc, Ahead<float>{});
        summed = true;
      }
    }
    if (!summed) {
      for (int h = 0; h < heads; ++h) {
        const T** hv = h == 0 ? vrows : w.head_rows(vrows, n, h * p.kv_stride_head);
        sum_values(hv, scores + h * per_head * kChunk, acc + h * per_head * D,
                   Ahead<T>{vnext, ahead, h * p.kv_stride_head});
      }
    }
    std::copy(knext, knext + nn, krows);
    std::copy(vnext, vnext + nn, vrows);
  }
  for (int g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    T* dst = out + (g / group_size) * out_token_stride + (g % group_size) * out_head_stride;
    for (int d = 0; d < D; ++d) dst[d] = from_float<T>(acc[g * D + d] * inv);
  }
}

// One unit of work: query rows [j0, j0 + nq) of sequence s, KV heads [h0, h0 + nh).
struct Task {
  int s, h0, nh, j0, nq;
  int64_t cost;  // task_cost() times its heads: orders the tasks, largest first
};

// Cost of one KV head's pass over `keys` keys for nq query rows: keys read times (rows + a streaming term).
inline int64_t task_cost(int keys, int nq) { return int64_t(keys) * (nq + 4); }

// Keys read by nq queries whose last sees `end` keys: all of them, or with a sliding window its span.
inline int keys_read(const pa_params& p, int end, int nq) {
  return p.sliding_window > 0 ? std::min(end, p.sliding_window + nq - 1) : end;
}

// Tasks of one call, largest first. A sequence with several query blocks (a prompt or prompt chunk) is split by
// KV head and block, so every thread shares it even beside many decodes. With at least two sequences per thread,
// a one-block sequence (a decode) goes whole, all KV heads in one task: the heads of a token share cache lines,
// so the second head's pass finds them in this core's cache instead of fetching them again; unless the whole
// task would be more than a thread's share of the call (a long context among short ones), which would leave one
// thread doing it alone. Largest first, handed out one at a time, keeps the big tasks from ending the call; a
// thread claims its next task when it starts one, so that task's first keys can be fetched early (NextTask).
std::vector<Task> make_tasks(const pa_params& p, const int32_t* context_lens, const int32_t* qsl, int block) {
  const int threads = omp_get_max_threads();
  int64_t total = 0;  // per KV head
  for (int s = 0; s < p.num_seqs; ++s) {
    const int num_q = qsl[s + 1] - qsl[s];
    total += task_cost(keys_read(p, context_lens[s], num_q), num_q);
  }
  std::vector<Task> tasks;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int num_q = qsl[s + 1] - qsl[s], first_key = context_lens[s] - num_q;
    const bool whole = p.num_seqs >= 2 * threads && num_q <= block &&
                       task_cost(keys_read(p, context_lens[s], num_q), num_q) * threads <= total;
    const int nh = whole ? p.num_kv_heads : 1;
    for (int j0 = 0; j0 < num_q; j0 += block)
      for (int h = 0; h < p.num_kv_heads; h += nh) {
        const int nq = std::min(block, num_q - j0);
        tasks.push_back({s, h, nh, j0, nq, nh * task_cost(keys_read(p, first_key + j0 + nq, nq), nq)});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

template <typename T>
void attention(const pa_params& p, const T* q, const T* kc, const T* vc, const int32_t* block_tables,
               const int32_t* context_lens, const int32_t* qsl, T* out) {
  const int group = p.num_heads / p.num_kv_heads, D = p.head_size;
  int max_q = 1;
  for (int s = 0; s < p.num_seqs; ++s) max_q = std::max(max_q, qsl[s + 1] - qsl[s]);
  const int block = std::min(max_q, std::max(1, kMaxRows / group));  // queries per block
  const std::vector<Task> tasks = make_tasks(p, context_lens, qsl, block);
  const int num_tasks = int(tasks.size());
  int64_t macs = 0;  // both products, every query token against its context (parallel_work.h)
  for (int s = 0; s < p.num_seqs; ++s) macs += int64_t(qsl[s + 1] - qsl[s]) * context_lens[s];
  macs *= int64_t(2) * p.num_heads * D;
  std::atomic<int> claim{0};
#pragma omp parallel if (num_tasks > 1 && inflight::worth_threads(macs))
  {
    // sized for this call: decode-only steps allocate a few rows, or a token's heads taken together
    constexpr bool is_bf16 = std::is_same<T, bf16>::value;
    const bool tiled = block * group >= kMinTiledRows;
    Scratch w(std::max(block * group, p.num_heads), D, tiled, is_bf16 && (tiled || !kBf16Dots),
              is_bf16 && kBf16Pairs && D % 32 == 0);
    // Tasks claimed one ahead, so the one after is known while this one runs (its first keys fetched early).
    int i = claim.fetch_add(1, std::memory_order_relaxed);
    while (i < num_tasks) {
      const int after = claim.fetch_add(1, std::memory_order_relaxed);
      const Task& task = tasks[i];
      NextTask<T> hint;
      Seq<T> hk{kc, nullptr, &p, 0}, hv{vc, nullptr, &p, 0};
      if (after < num_tasks && tasks[after].nq == 1 && tasks[after].nh == task.nh && p.sliding_window == 0) {
        const Task& t2 = tasks[after];
        hk.table = hv.table = block_tables + int64_t(t2.s) * p.max_blocks_per_seq;
        hk.kv_head = hv.kv_head = t2.h0;
        hint = {&hk, &hv, context_lens[t2.s] - (qsl[t2.s + 1] - qsl[t2.s]) + t2.j0 + 1};
      }
      const int s = task.s, j0 = task.j0, nq = task.nq;
      const int32_t* table = block_tables + int64_t(s) * p.max_blocks_per_seq;
      const int q0 = qsl[s], num_q = qsl[s + 1] - qsl[s], len = context_lens[s];
      // one query row group per head (untiled): the task's heads in one pass over the keys
      const int together = nq == 1 && group < kMinTiledRows ? task.nh : 1;
      for (int h = task.h0; h < task.h0 + task.nh; h += together) {
        const Seq<T> k{kc, table, &p, h}, v{vc, table, &p, h};
        for (int j = 0; j < nq; ++j) {
          const int64_t t = q0 + j0 + j;
          for (int g = 0; g < together * group; ++g) {
            const int r = j * group + g;
            const T* row = q + t * p.q_stride_token + int64_t(h * group + g) * p.q_stride_head;
            for (int d = 0; d < D; ++d) w.q[r * D + d] = to_float(row[d]) * p.scale;
            if (!w.qp.empty()) std::memcpy(w.qp.data() + r * D / 2, row, D * sizeof(T));
            w.limit[r] = len - num_q + j0 + j + 1;  // causal: query j0 + j sees this many keys
            w.first[r] = p.sliding_window > 0 ? std::max(0, w.limit[r] - p.sliding_window) : 0;
          }
        }
        const int rows = nq * group * together;
        T* dst = out + (q0 + j0) * p.out_stride_token + int64_t(h * group) * p.out_stride_head;
        if (together == 1 && rows >= kMinTiledRows)
          attend<true>(p, rows, group, 1, k, v, len - num_q + j0 + nq, w, dst, p.out_stride_token, p.out_stride_head);
        else
          attend<false>(p, rows, group * together, together, k, v, len - num_q + j0 + nq, w, dst, p.out_stride_token,
                        p.out_stride_head, h + together >= task.h0 + task.nh ? hint : NextTask<T>{});
      }
      i = after;
    }
  }
}

// Elements of K (as many of V) below which one thread writes them: a decode step's few rows are copied in
// microseconds, and a parallel region's barrier waits a whole scheduler slice when the other core is busy (the
// serving path's threads).
constexpr int64_t kParallelKvElements = 1 << 18;

template <typename T>
void write_kv(const pa_params& p, const T* k, const T* v, int64_t st, int64_t sh, const int64_t* slots, T* kc,
              T* vc) {
  const size_t bytes = sizeof(T) * p.head_size;
#pragma omp parallel for if (int64_t(p.num_tokens) * p.num_kv_heads * p.head_size >= kParallelKvElements)
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t base = (slot / p.block_size) * p.kv_stride_block + (slot % p.block_size) * p.kv_stride_token;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      std::memcpy(kc + base + h * p.kv_stride_head, k + t * st + h * sh, bytes);
      std::memcpy(vc + base + h * p.kv_stride_head, v + t * st + h * sh, bytes);
    }
  }
}

int check(const pa_params* p) {
  if (p->dtype != PA_FLOAT32 && p->dtype != PA_BFLOAT16) return PA_ERR_DTYPE;
  if (p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0 || p->head_size <= 0 || p->block_size <= 0 ||
      p->sliding_window < 0)
    return PA_ERR_SHAPE;
  return PA_OK;
}

}  // namespace

extern "C" int pa_cpu_attention(const pa_params* p, const void* q, const void* k_cache, const void* v_cache,
                                const int32_t* block_tables, const int32_t* context_lens,
                                const int32_t* query_start_loc, void* out) {
  if (int err = check(p)) return err;
  if (p->dtype == PA_FLOAT32)
    attention(*p, static_cast<const float*>(q), static_cast<const float*>(k_cache),
              static_cast<const float*>(v_cache), block_tables, context_lens, query_start_loc,
              static_cast<float*>(out));
  else
    attention(*p, static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache),
              block_tables, context_lens, query_start_loc, static_cast<bf16*>(out));
  return PA_OK;
}

extern "C" int pa_cpu_write_kv(const pa_params* p, const void* k, const void* v, int64_t st, int64_t sh,
                               const int64_t* slot_mapping, void* k_cache, void* v_cache) {
  if (int err = check(p)) return err;
  if (p->dtype == PA_FLOAT32)
    write_kv(*p, static_cast<const float*>(k), static_cast<const float*>(v), st, sh, slot_mapping,
             static_cast<float*>(k_cache), static_cast<float*>(v_cache));
  else
    write_kv(*p, static_cast<const bf16*>(k), static_cast<const bf16*>(v), st, sh, slot_mapping,
             static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache));
  return PA_OK;
}
