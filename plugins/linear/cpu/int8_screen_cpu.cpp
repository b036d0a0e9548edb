// Greedy screen for a bf16 model's LM head (see include/int8_screen.h for the bound and why it is exact): int8
// panels walked with AVX512-VNNI for the screen, the bf16 GEMM's own VDPBF16PS chain for the refine.
#include "int8_screen.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include <vector>

#include "bf16_gemm.h"
#include "bf16_panels.h"
#include "claimed_ranges.h"
#include "parallel_work.h"
#include "logit_rows.h"
#include "row_split.h"
#include "skinny_gemm.h"

#ifdef GS_BUILD
#define GQ_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vnni")))
#endif

namespace {

// Panels mirror the bf16 ones (bf16_panels.h) with quads of k for pairs: per tile of kTile = 64 columns, ceil(K/4)
// quad rows of 64 columns x 4 int8 (256 bytes), so that one 64-byte load is 16 columns' (q[4g..4g+3][n]) quads,
// the operand VPDPBUSD multiplies with a broadcast quad of x's unsigned bytes (q_x + 128; the sums of q_n take the
// 128 back out).
constexpr int64_t kTile = 64, kSlab = 96, kMaxK = 65536;
constexpr int kRows = 6;

int64_t quads(int64_t K) { return (K + 3) / 4; }

float widen(uint16_t bits) {
  const uint32_t b = (uint32_t)bits << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// gamma_K: a K-term fp32 sum, each step rounded to nearest or toward zero.
double gamma(int64_t K) {
  const double g = (double)K * ldexp(1.0, -23);
  return g / (1.0 - g);
}

// One row of x quantized: a = max|x| / 127, q = round(x / a), and the norms the bound needs. False where the row
// is not safe to approximate: a value not finite, every value zero, or logits that could reach the range where
// fp32 sums overflow (||x|| ||w|| < 2^100 keeps every partial sum far from it). `bytes` (when given) receives
// q + 128 for ceil(K/4) * 4 values, 128 past K.
struct RowQuant {
  float a = 0;
  double x = 0, xq = 0, dx = 0;
};
bool quantize(const uint16_t* x, int64_t K, const double* w_norms, RowQuant* r, uint8_t* bytes) {
  float m = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float v = fabsf(widen(x[k]));
    if (!(v < INFINITY)) return false;
    m = v > m ? v : m;
  }
  if (m == 0) return false;
  const float a = m / 127.0f;
  double sx = 0, sq = 0, sd = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float v = widen(x[k]);
    float q = nearbyintf(v / a);
    q = q > 127 ? 127 : q < -127 ? -127 : q;
    const double aq = (double)a * q, d = (double)v - aq;  // both exact in double
    sx += (double)v * v, sq += aq * aq, sd += d * d;
    if (bytes) bytes[k] = (uint8_t)((int)q + 128);
  }
  if (bytes)
    for (int64_t k = K; k < quads(K) * 4; ++k) bytes[k] = 128;
  const double up = 1.0 + 1e-12;  // the sums' double rounding, outweighed
  r->a = a, r->x = sqrt(sx) * up, r->xq = sqrt(sq) * up, r->dx = sqrt(sd) * up;
  return r->x * w_norms[0] < ldexp(1.0, 100);
}

// B_n for a row (the header's bound) = c + alpha ||dw_n|| + beta ||s_n q_n||, each coefficient rounded up so
// that B_n computed in fp32 (three roundings) stays above the bound; L: the largest finite |A_j| of its logits.
struct Bound {
  float c, alpha, beta;
  float at(float ndw, float nq) const { return c + alpha * ndw + beta * nq; }
};
Bound bound(int64_t K, const RowQuant& r, const double* w_norms, double L) {
  const double k = 1.01 * (1.0 + ldexp(1.0, -8)), up = 1.0 + ldexp(1.0, -18), nw = w_norms[0];
  const double c = k * (gamma(K) * r.x * nw + (double)K * ldexp(1.0, -120) * (2.0 + r.x + nw)) +
                   1.01 * L * (ldexp(1.0, -8) + ldexp(1.0, -20)) + ldexp(1.0, -90);
  // (2^-90 absolute: a s_n underflowing to a denormal, or to zero where flushed, in the screen's scaling)
  return {(float)(c * up), (float)(k * (r.xq + r.dx) * up), (float)(k * r.dx * up)};
}

#ifdef GS_BUILD
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on the intrinsics' own undefined passthroughs
#pragma GCC diagnostic ignored "-Wuninitialized"

// Rows [0, R) of y (row stride N), tile at column n0: each row's quads (row stride ldq) . the panel's, over all Q
// quad rows, exact in int32, then (sum - 128 sums_n) * (a_i * s_n) in fp32; prefetching `lines` cache lines of
// the next tile's panel, `per` a quad row from line `first` of this pass on, or, where `ahead` > 0, the quad row
// `ahead` bytes past each one loaded (as the bf16 walk: sg_stream_ahead). (Each plan its own instantiation: with
// both in one loop GCC 12 spilled the accumulators.)
template <int R, bool kStream>
GQ_TARGET void row_block(const uint32_t* xq, int64_t ldq, int64_t Q, const int8_t* panel, int64_t N, int64_t n0,
                         const float* a, const float* scales, const int32_t* sums, float* y, const char* next,
                         int64_t first, int64_t lines, int per, int64_t ahead) {
  // int32 sums kept as __m512 (cast, not converted): GCC 12 spills an __m512i accumulator array here, not this
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < Q; ++g, panel += 4 * kTile) {
    if (kStream) {
      const char* line = reinterpret_cast<const char*>(panel) + ahead;
      for (int j = 0; j < 4; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
    } else if (first < lines) {
      for (int j = 0; j < per; ++j) _mm_prefetch(next + 64 * (first + j), _MM_HINT_T1);
      first += per;
    }
    const __m512i w0 = _mm512_loadu_si512(panel), w1 = _mm512_loadu_si512(panel + 64);
    const __m512i w2 = _mm512_loadu_si512(panel + 128), w3 = _mm512_loadu_si512(panel + 192);
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_set1_epi32((int)xq[i * ldq + g]);
      acc[i][0] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[i][0]), xv, w0));
      acc[i][1] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[i][1]), xv, w1));
      acc[i][2] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[i][2]), xv, w2));
      acc[i][3] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[i][3]), xv, w3));
    }
  }
  for (int j = 0; j < 4; ++j) {  // (a mask of 0 past N: nothing loaded or stored)
    const int64_t left = N - n0 - 16 * j;
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(m, scales + n0 + 16 * j);
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, sums + n0 + 16 * j), 7);  // 128 sums_n
    for (int i = 0; i < R; ++i) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_castps_si512(acc[i][j]), offset));
      _mm512_mask_storeu_ps(y + i * N + n0 + 16 * j, m, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(a[i]), s)));
    }
  }
}

// y (M, N) = the approximate logits of every row, slabs of kSlab rows each over every tile (claimed_ranges.h);
// `ahead`: sg_stream_ahead's distance, taken where a slab is one row block.
GQ_TARGET void walk(const uint32_t* xq, int64_t M, int64_t Q, const float* a, const int8_t* packed,
                    const float* scales, const int32_t* sums, int64_t N, float* y, int64_t ahead) {
  using Fn = void (*)(const uint32_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, const float*,
                      const float*, const int32_t*, float*, const char*, int64_t, int64_t, int, int64_t);
  static constexpr Fn kBlocks[kRows + 1] = {nullptr, row_block<1, false>, row_block<2, false>, row_block<3, false>,
                                            row_block<4, false>, row_block<5, false>, row_block<6, false>};
  // (5 and 6 streamed rows spill accumulators under GCC 12: those take the next-tile prefetch)
  static constexpr Fn kStreamed[kRows + 1] = {nullptr, row_block<1, true>, row_block<2, true>, row_block<3, true>,
                                              row_block<4, true>, row_block<5, false>, row_block<6, false>};
  const int64_t tiles = (N + kTile - 1) / kTile, panel_bytes = Q * 4 * kTile, lines = panel_bytes / 64;
  for (int64_t s0 = 0; s0 < M; s0 += kSlab) {
    const int64_t slab_rows = M - s0 < kSlab ? M - s0 : kSlab;
    const inflight::RowSplit split(slab_rows, kRows);
    const int per = (int)((lines + split.blocks * Q - 1) / (split.blocks * Q));
    const int64_t stream = split.blocks == 1 ? ahead : 0;
    inflight::ClaimedRanges work(tiles, omp_get_max_threads());
#pragma omp parallel if (inflight::worth_threads(slab_rows * Q * 4 * N))
    for (int64_t t; (t = work.next(omp_get_thread_num())) >= 0;) {
      const int8_t* panel = packed + t * panel_bytes;
      const char* next = t + 1 < tiles ? reinterpret_cast<const char*>(panel + panel_bytes) : nullptr;
      for (int64_t b = 0, m0 = s0; b < split.blocks; ++b) {
        const int rows = split.rows(b);
        (stream > 0 ? kStreamed : kBlocks)[rows](xq + m0 * Q, Q, Q, panel, N, t * kTile, a + m0, scales, sums,
                                                 y + m0 * N, next, b * Q * per, next ? lines : 0, per, stream);
        m0 += rows;
      }
    }
  }
}

// The 16 x 16 dwords r[i][j] -> c[j][i], in registers (unpacks within 128-bit lanes, then the lanes exchanged).
GQ_TARGET inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + e], 128-bit lane L: element 4L + e of rows 4i..4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // c[4L + e] = lane L of b[e], b[4 + e], b[8 + e], b[12 + e]
    const __m512i d0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), d1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
    const __m512i d2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
    const __m512i d3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(d0, d2, 0x88), r[4 + e] = _mm512_shuffle_i32x4(d0, d2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(d1, d3, 0x88), r[12 + e] = _mm512_shuffle_i32x4(d1, d3, 0xDD);
  }
}

// out[c] = the bf16 GEMM's value of column cols[c] for x's pairs xp, widened: the same VDPBF16PS chain over the
// pairs in order from zero (bf16_panels.h's row_block), 16 columns in 16 lanes. Each block of 16 pairs is read
// from the 16 columns' (N, K) rows (a 64-byte load each) and transposed in registers so that lane i holds
// column i's pairs.
constexpr int64_t kAhead = 512;  // bytes fetched ahead of each row's loads (the rows come from memory)

GQ_TARGET void exact_columns(const uint32_t* xp, int64_t K, const uint16_t* rows, int64_t ld_rows,
                             const int32_t* cols, int64_t C, float* out) {
  const int64_t full = K / 2;  // whole pairs in a row (an odd K's last value is its own, half-zero pair)
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    const int lanes = C - c0 < 16 ? (int)(C - c0) : 16;
    const uint16_t* row[16];
    for (int l = 0; l < 16; ++l) row[l] = rows + (int64_t)cols[c0 + (l < lanes ? l : 0)] * ld_rows;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < full; p0 += 16) {
      const int n = full - p0 < 16 ? (int)(full - p0) : 16;
      const __mmask16 m = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
      __m512i w[16];
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(row[l] + 2 * p0) + kAhead, _MM_HINT_T0);
        w[l] = _mm512_maskz_loadu_epi32(m, row[l] + 2 * p0);
      }
      transpose16(w);
      for (int j = 0; j < n; ++j)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)w[j], (__m512bh)_mm512_set1_epi32((int)xp[p0 + j]));
    }
    if (K % 2) {  // the last pair's second value is zero, as in the panels
      alignas(64) uint32_t last[16];
      for (int l = 0; l < 16; ++l) last[l] = row[l][K - 1];
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(last), (__m512bh)_mm512_set1_epi32((int)xp[full]));
    }
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(acc)), 16);
    alignas(64) float vals[16];
    _mm512_store_ps(vals, _mm512_castsi512_ps(bits));
    memcpy(out + c0, vals, lanes * sizeof(float));
  }
}

// The columns whose logit could be the row's largest: with LB = max_j (A_j - B_j), a lower bound of the largest
// exact logit, every n with A_n + B_n >= LB (or NaN); the others' exact logits are below LB. In fp32, with a
// margin for the two passes' roundings (each within 2^-24 of |A| + B). L: the row's largest finite |A_j|, as the
// bound took it.
GQ_TARGET void candidates(const float* y, int64_t N, double L, const Bound& b, const float* col_norms,
                          const double* norms, std::vector<int32_t>* cols) {
  const __m512 c = _mm512_set1_ps(b.c), alpha = _mm512_set1_ps(b.alpha), beta = _mm512_set1_ps(b.beta);
  const float* ndw = col_norms;
  const float* nq = col_norms + N;
  __m512 lower = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  auto bound_at = [&](int64_t j) {
    return _mm512_fmadd_ps(beta, _mm512_loadu_ps(nq + j), _mm512_fmadd_ps(alpha, _mm512_loadu_ps(ndw + j), c));
  };
  for (; j + 16 <= N; j += 16) {
    const __m512 bj = bound_at(j);
    lower = _mm512_max_ps(lower, _mm512_sub_ps(_mm512_loadu_ps(y + j), bj));  // (no NaN: gq_refine skips those rows)
  }
  float lanes[16], lb = -INFINITY;
  _mm512_storeu_ps(lanes, lower);
  for (float v : lanes) lb = v > lb ? v : lb;
  for (int64_t t = j; t < N; ++t) lb = y[t] - b.at(ndw[t], nq[t]) > lb ? y[t] - b.at(ndw[t], nq[t]) : lb;
  const double largest = L + b.at((float)norms[2], (float)norms[1]);
  const float threshold = (float)((double)lb - ldexp(largest, -20) - ldexp(1.0, -100));
  const __m512 t = _mm512_set1_ps(threshold);
  for (j = 0; j + 16 <= N; j += 16) {
    const __m512 bj = bound_at(j);
    for (unsigned m = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(y + j), bj), t, _CMP_NLT_UQ); m; m &= m - 1)
      cols->push_back((int32_t)(j + __builtin_ctz(m)));  // >=, or NaN
  }
  for (; j < N; ++j)
    if (!(y[j] + b.at(ndw[j], nq[j]) < threshold)) cols->push_back((int32_t)j);
}

#pragma GCC diagnostic pop
#endif  // GS_BUILD

}  // namespace

extern "C" int gq_available(void) {
#ifdef GS_BUILD
  static const int ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return 0;
#endif
}

extern "C" int64_t gq_packed_size(int64_t K, int64_t N) { return (N + kTile - 1) / kTile * quads(K) * 4 * kTile; }

extern "C" int gq_pack(const uint16_t* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, int8_t* packed,
                       float* scales, int32_t* sums, double* norms, float* col_norms) {
  if (K <= 0 || N <= 0 || K > kMaxK) return SG_ERR_SHAPE;
  const int64_t Q = quads(K);
  std::vector<double> sw(N), sq(N), sd(N);
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
  for (int64_t n = 0; n < N; ++n) {
    float m = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = fabsf(widen(w[k * stride_k + n * stride_n]));
      bad += !(v < INFINITY);
      m = v > m ? v : m;
    }
    const float s = m / 127.0f;
    double s0 = 0, s1 = 0, s2 = 0;
    int32_t total = 0;
    int8_t* col = packed + (n / kTile) * Q * 4 * kTile + (n % kTile) * 4;
    for (int64_t k = 0; k < Q * 4; ++k) {
      float q = 0;
      if (k < K && s > 0) {
        const float v = widen(w[k * stride_k + n * stride_n]);
        q = nearbyintf(v / s);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        const double sqv = (double)s * q, d = (double)v - sqv;  // both exact in double
        s0 += (double)v * v, s1 += sqv * sqv, s2 += d * d;
      } else if (k < K) {
        const double v = widen(w[k * stride_k + n * stride_n]);
        s0 += v * v, s2 += v * v;
      }
      col[(k / 4) * 4 * kTile + k % 4] = (int8_t)q;
      total += (int32_t)q;
    }
    scales[n] = s, sums[n] = total, sw[n] = s0, sq[n] = s1, sd[n] = s2;
    col_norms[n] = nextafterf((float)(sqrt(s2) * (1.0 + 1e-12)), INFINITY);      // ||dw_n||, rounded up
    col_norms[N + n] = nextafterf((float)(sqrt(s1) * (1.0 + 1e-12)), INFINITY);  // ||s_n q_n||
  }
  if (bad) return SG_ERR_SHAPE;
  // the last tile's columns past N: zero weights, which add nothing to any sum
  int8_t* last = packed + (N - 1) / kTile * Q * 4 * kTile;
  for (int64_t g = 0; g < Q; ++g)
    memset(last + g * 4 * kTile + (N - 1) % kTile * 4 + 4, 0, (kTile - 1 - (N - 1) % kTile) * 4);
  double most[3] = {0, 0, 0};
  for (int64_t n = 0; n < N; ++n) {
    most[0] = sw[n] > most[0] ? sw[n] : most[0];
    most[1] = sq[n] > most[1] ? sq[n] : most[1];
    most[2] = sd[n] > most[2] ? sd[n] : most[2];
  }
  for (int i = 0; i < 3; ++i) norms[i] = sqrt(most[i]) * (1.0 + 1e-12);
  return SG_OK;
}

extern "C" int gq_screen(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const int8_t* packed,
                         const float* scales, const int32_t* sums, const uint16_t* packed_bf16, const double* norms,
                         int64_t N, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || K > kMaxK) return SG_ERR_SHAPE;
#ifdef GS_BUILD
  if (!gq_available()) return SG_ERR_UNSUPPORTED;
  if (M == 0) return SG_OK;
  const int64_t Q = quads(K);
  std::vector<uint32_t> xq(M * Q);
  std::vector<float> a(M);
  std::vector<char> safe(M);
  for (int64_t i = 0; i < M; ++i) {
    RowQuant r;
    safe[i] = quantize(x + i * ldx, K, norms, &r, reinterpret_cast<uint8_t*>(xq.data() + i * Q));
    a[i] = safe[i] ? r.a : 0.0f;
  }
  walk(xq.data(), M, Q, a.data(), packed, scales, sums, N, y, sg_stream_ahead(-1));
  std::vector<uint16_t> row;
  for (int64_t i = 0; i < M; ++i)  // rows not safe to screen: the bf16 GEMM's logits, whole (rare)
    if (!safe[i]) {
      row.resize(N);
      const int status = sg_bf16_gemm(x + i * ldx, 1, K, ldx, packed_bf16, N, nullptr, row.data());
      if (status != SG_OK) return status;
      for (int64_t n = 0; n < N; ++n) y[i * N + n] = widen(row[n]);
    }
  return SG_OK;
#else
  (void)x, (void)ldx, (void)packed, (void)scales, (void)sums, (void)packed_bf16, (void)norms, (void)y;
  return SG_ERR_UNSUPPORTED;
#endif
}

extern "C" int gq_bounds(const uint16_t* x, int64_t K, const double* norms, const float* col_norms, int64_t N,
                         double largest, float* bounds) {
  RowQuant r;
  if (K <= 0 || N <= 0 || !quantize(x, K, norms, &r, nullptr)) return SG_ERR_SHAPE;
  const Bound b = bound(K, r, norms, largest);
  for (int64_t n = 0; n < N; ++n) bounds[n] = b.at(col_norms[n], col_norms[N + n]);
  return SG_OK;
}

extern "C" int64_t gq_refine(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* rows,
                             int64_t ld_rows, const double* norms, const float* col_norms, int64_t N, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || ld_rows < K || K > kMaxK)
    return -SG_ERR_SHAPE;
#ifdef GS_BUILD
  if (!gq_available()) return -SG_ERR_UNSUPPORTED;
  const int64_t P = inflight::bf16::pairs(K);
  int64_t total = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total) if (M > 1 && inflight::refine_worth_threads(M, K, N))
  for (int64_t i = 0; i < M; ++i) {
    const uint16_t* xi = x + i * ldx;
    float* yi = y + i * N;
    RowQuant r;
    if (!quantize(xi, K, norms, &r, nullptr)) continue;  // gq_screen computed this row with the bf16 GEMM
    const float top = inflight::logits::row_max(yi, N);
    if (!isfinite(top)) continue;  // every token masked, or a NaN or inf the caller put there: left as it is
    std::vector<int32_t> cols;
    const double L = inflight::logits::largest_finite(yi, N);
    candidates(yi, N, L, bound(K, r, norms, L), col_norms, norms, &cols);
    std::vector<uint32_t> xp(P);
    for (int64_t p = 0; p < P; ++p) xp[p] = xi[2 * p] | (2 * p + 1 < K ? (uint32_t)xi[2 * p + 1] << 16 : 0u);
    std::vector<float> exact(cols.size());
    exact_columns(xp.data(), K, rows, ld_rows, cols.data(), (int64_t)cols.size(), exact.data());
    for (size_t c = 0; c < cols.size(); ++c) yi[cols[c]] = exact[c];
    total += (int64_t)cols.size();
  }
  return total;
#else
  (void)x, (void)rows, (void)norms, (void)col_norms, (void)y;
  return -SG_ERR_UNSUPPORTED;
#endif
}
