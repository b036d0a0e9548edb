// Greedy screen for the LM head (see include/greedy_screen.h for the bound and why it is exact). Its bf16 panels
// and their AVX512-BF16 walk are bf16_panels.h's; without AVX512-BF16 the same panels are widened to fp32 here.
#include "greedy_screen.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "bf16_panels.h"
#include "claimed_ranges.h"
#include "parallel_work.h"
#include "logit_rows.h"
#include "row_split.h"
#include "skinny_gemm.h"

namespace {

using inflight::bf16::kTile;
using inflight::bf16::pairs;
using inflight::bf16::to_bf16;

// gamma_K of the header's bound: a K-term fp32 sum, each step rounded to nearest or toward zero.
double gamma(int64_t K) {
  const double g = (double)K * ldexp(1.0, -23);
  return g / (1.0 - g);
}

// Norms of one row of x: of x, of its bf16 rounding x^ and of the difference; false when the row is not safe to
// screen: a value not finite, or logits that could reach the range where fp32 sums overflow (|x . w| <=
// ||x|| ||w|| < 2^100 keeps every partial sum far from it).
struct RowNorms {
  double x = 0, xb = 0, dx = 0;
};
bool row_norms(const float* x, int64_t K, const double* w_norms, RowNorms* out) {
  double sx = 0, sb = 0, sd = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (!isfinite(x[k])) return false;
    uint32_t bits = (uint32_t)to_bf16(x[k]) << 16;
    float b;
    memcpy(&b, &bits, 4);
    const double d = (double)x[k] - (double)b;  // exact in double
    sx += (double)x[k] * x[k], sb += (double)b * b, sd += d * d;
  }
  const double up = 1.0 + 1e-12;  // the sums' double rounding, outweighed
  out->x = sqrt(sx) * up, out->xb = sqrt(sb) * up, out->dx = sqrt(sd) * up;
  return out->x * w_norms[0] < ldexp(1.0, 100) && out->xb * w_norms[1] < ldexp(1.0, 100);
}

// B for a row (the header's bound): x w - x^ w^ = x^ dw + dx w^ + dx dw, each sum bounded by Cauchy-Schwarz with
// the weight's largest column norms; the two fp32 sums' rounding; an absolute term for bf16 denormals (VDPBF16PS
// reads them as zero and flushes its results: at most 2^-126 a term and a sum, K of each); 1% to spare for the
// double arithmetic.
double bound(int64_t K, const RowNorms& r, const double* w_norms) {
  const double nw = w_norms[0], nwb = w_norms[1], ndw = w_norms[2], g = gamma(K);
  return 1.01 * (r.xb * ndw + r.dx * nwb + r.dx * ndw + g * r.xb * nwb + g * r.x * nw +
                 (double)K * ldexp(1.0, -120) * (2.0 + r.xb + nwb));
}

#ifdef GS_BUILD

// Without AVX512-BF16: the same panels widened to fp32 in registers (a pair's low half shifted up is w[2p], its
// high half masked is w[2p+1]) and multiplied with x's fp32 values by FMAs, 16 columns (a quarter tile) and up to
// 4 rows at a time (8 accumulators, 4 weight vectors and 2 broadcasts of AVX2's 16 registers). Half the fp32
// GEMM's bytes for as many FMAs; x is not rounded (dx = 0: the bound covers that case too).
constexpr int kRowsAvx2 = 4;

template <int R>
GS_AVX2 void row_block_avx2(const float* x, int64_t ldx, int64_t K, const uint16_t* part, int64_t N, int64_t c0,
                            float* y) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t p = 0; p < pairs(K); ++p, part += 2 * kTile) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part + 16));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
    for (int i = 0; i < R; ++i) {
      const __m256 x0 = _mm256_set1_ps(x[i * ldx + 2 * p]);
      acc[i][0] = _mm256_fmadd_ps(x0, e0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x0, e1, acc[i][1]);
      if (p < full) {  // (an odd K's last pair has no second value)
        const __m256 x1 = _mm256_set1_ps(x[i * ldx + 2 * p + 1]);
        acc[i][0] = _mm256_fmadd_ps(x1, o0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x1, o1, acc[i][1]);
      }
    }
  }
  const int64_t width = N - c0 < 16 ? N - c0 : 16;
  for (int i = 0; i < R; ++i) {
    float out[16];
    _mm256_storeu_ps(out, acc[i][0]);
    _mm256_storeu_ps(out + 8, acc[i][1]);
    memcpy(y + i * N + c0, out, width * sizeof(float));
  }
}

using RowBlockAvx2Fn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*);
constexpr RowBlockAvx2Fn kRowBlocksAvx2[kRowsAvx2 + 1] = {nullptr, row_block_avx2<1>, row_block_avx2<2>,
                                                          row_block_avx2<3>, row_block_avx2<4>};

void screen_rows_avx2(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed, int64_t N,
                      float* y) {
  const int64_t tiles = (N + kTile - 1) / kTile, panel_values = pairs(K) * 2 * kTile;
  const inflight::RowSplit split(M, kRowsAvx2);
  inflight::ClaimedRanges work(tiles, omp_get_max_threads());
#pragma omp parallel if (inflight::worth_threads(M * K * N))
  for (int64_t t; (t = work.next(omp_get_thread_num())) >= 0;)
    for (int64_t q = 0; q < kTile / 16 && t * kTile + 16 * q < N; ++q)
      for (int64_t b = 0, m0 = 0; b < split.blocks; ++b) {
        const int rows = split.rows(b);
        kRowBlocksAvx2[rows](x + m0 * ldx, ldx, K, packed + t * panel_values + 32 * q, N, t * kTile + 16 * q,
                             y + m0 * N);
        m0 += rows;
      }
}

#endif  // GS_BUILD

}  // namespace

namespace {
std::atomic<int> widen_only{0};  // gs_widen_only: the AVX2 path even where AVX512-BF16 would run (tests)
}

extern "C" int gs_widen_only(int on) {
  if (on >= 0) widen_only.store(on ? 1 : 0);
  return widen_only.load();
}

extern "C" int gs_available(void) {
#ifdef GS_BUILD
  static const int bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  static const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return bf16 && !widen_only.load() ? 2 : avx2 ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int64_t gs_packed_size(int64_t K, int64_t N) { return inflight::bf16::packed_size(K, N); }

extern "C" int gs_pack(const float* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, uint16_t* packed,
                       double* norms) {
  if (K <= 0 || N <= 0) return SG_ERR_SHAPE;
  std::vector<double> sw(N, 0.0), sb(N, 0.0), sd(N, 0.0);
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
  for (int64_t n = 0; n < N; ++n) {
    double s0 = 0, s1 = 0, s2 = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = w[k * stride_k + n * stride_n];
      bad += !isfinite(v);
      uint32_t bits = (uint32_t)to_bf16(v) << 16;
      float b;
      memcpy(&b, &bits, 4);
      const double d = (double)v - (double)b;
      s0 += (double)v * v, s1 += (double)b * b, s2 += d * d;
    }
    sw[n] = s0, sb[n] = s1, sd[n] = s2;
  }
  if (bad) return SG_ERR_SHAPE;
  double most[3] = {0, 0, 0};
  for (int64_t n = 0; n < N; ++n) {
    most[0] = sw[n] > most[0] ? sw[n] : most[0];
    most[1] = sb[n] > most[1] ? sb[n] : most[1];
    most[2] = sd[n] > most[2] ? sd[n] : most[2];
  }
  for (int i = 0; i < 3; ++i) norms[i] = sqrt(most[i]) * (1.0 + 1e-12);
  inflight::bf16::pack_panels(K, N, packed,
                              [=](int64_t k, int64_t n) { return to_bf16(w[k * stride_k + n * stride_n]); });
  return SG_OK;
}

extern "C" int gs_screen(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed,
                         const float* packed_f32, const double* norms, int64_t N, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K) return SG_ERR_SHAPE;
#ifdef GS_BUILD
  const int path = gs_available();
  if (!path) return SG_ERR_UNSUPPORTED;
  if (M == 0) return SG_OK;
  if (path == 2) {
    const int64_t P = pairs(K);
    std::vector<uint32_t> xp(M * P);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t p = 0; p < P; ++p) {
        const uint32_t lo = to_bf16(x[i * ldx + 2 * p]), hi = 2 * p + 1 < K ? to_bf16(x[i * ldx + 2 * p + 1]) : 0;
        xp[i * P + p] = lo | hi << 16;
      }
    inflight::bf16::walk(xp.data(), P, M, P, packed, N, nullptr, y, sg_stream_ahead(-1));
  } else {
    screen_rows_avx2(x, M, K, ldx, packed, N, y);
  }
  RowNorms r;
  for (int64_t i = 0; i < M; ++i)  // rows not safe to screen: the fp32 GEMM's logits, whole (rare)
    if (!row_norms(x + i * ldx, K, norms, &r)) {
      const int status = sg_gemm_f32(x + i * ldx, 1, K, ldx, packed_f32, N, nullptr, y + i * N);
      if (status != SG_OK) return status;
    }
  return SG_OK;
#else
  (void)x, (void)ldx, (void)packed, (void)packed_f32, (void)norms, (void)y;
  return SG_ERR_UNSUPPORTED;
#endif
}

extern "C" int64_t gs_refine(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed_f32,
                             const double* norms, int64_t N, float* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || N > INT32_MAX) return -SG_ERR_SHAPE;
  int64_t total = 0;
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total, failed) if (M > 1 && inflight::refine_worth_threads(M, K, N))
  for (int64_t i = 0; i < M; ++i) {
    const float* xi = x + i * ldx;
    float* yi = y + i * N;
    RowNorms r;
    if (!row_norms(xi, K, norms, &r)) continue;  // gs_screen computed this row in fp32
    const float top = inflight::logits::row_max(yi, N);
    if (!isfinite(top)) continue;  // every token masked, or a NaN or inf the caller put there: left as it is
    // Candidates: approx_j >= top - 2B, compared in double (exact for fp32 values) against a threshold rounded
    // down to a float.
    const double below = (double)top - 2.0 * bound(K, r, norms);
    float threshold = (float)below;
    if ((double)threshold > below) threshold = nextafterf(threshold, -INFINITY);
    std::vector<int32_t> cols;
    inflight::logits::at_or_above(yi, N, threshold, &cols);
    std::vector<float> exact(cols.size());
    if (sg_dot_columns(xi, K, packed_f32, N, cols.data(), (int64_t)cols.size(), exact.data()) != SG_OK) {
      failed += 1;
      continue;
    }
    for (size_t c = 0; c < cols.size(); ++c) yi[cols[c]] = exact[c];
    total += (int64_t)cols.size();
  }
  return failed ? -SG_ERR_SHAPE : total;
}
