// Fused fp32 CPU ops (see include/cpu_ops.h). Loops are written for the compiler's vectoriser (omp simd) and
// split over rows with OpenMP only when there is enough work to pay for waking the threads.
#include "cpu_ops.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kParallelWork = 1 << 15;  // elements below which one thread does the whole call
// The argmax reads each element once and does no arithmetic: one thread takes 32 rows of a 32,000-word
// vocabulary (1M elements) in well under a step's millisecond, and a parallel region costs a barrier, which waits
// a whole scheduler slice when the other core is busy (the serving path's threads, at hundreds of streams).
constexpr int64_t kArgmaxParallelWork = 1 << 20;

using inflight::exp_clamped;

int64_t argmax_row(const float* __restrict x, int64_t n) {
  // Two vectorised passes over the row (it stays in L2): its maximum, counting NaNs on the way (NaN never
  // compares greater), then the first block holding the maximum and the index within it. Counts, not flags:
  // the vectoriser handles integer sums where it gives up on boolean ones.
  float m = -INFINITY;
  int nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    nans += x[i] != x[i];
  }
  if (nans) {
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  constexpr int64_t kBlock = 256;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    int hits = 0;
#pragma omp simd reduction(+ : hits)
    for (int64_t i = b; i < e; ++i) hits += x[i] == m;
    if (hits)
      for (int64_t i = b; i < e; ++i)
        if (x[i] == m) return i;
  }
  return 0;  // every value -inf: index 0, as torch
}

// One row of RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)).
inline void rms_norm_row(const float* __restrict x, int64_t n, const float* __restrict weight, float eps,
                         float* __restrict y) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / float(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = weight[i] * (x[i] * inv);
}

}  // namespace

extern "C" int ops_rms_norm_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, const float* weight,
                                float eps, float* y) {
  if (rows < 0 || n <= 0 || ldx < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * ldx, n, weight, eps, y + r * n);
  return OPS_OK;
}

extern "C" int ops_add_rms_norm_f32(float* residual, const float* h, int64_t rows, int64_t n, int64_t ldr,
                                    int64_t ldh, const float* weight, float eps, float* y) {
  if (rows < 0 || n <= 0 || ldr < n || ldh < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict rr = residual + r * ldr;
    const float* __restrict hr = h + r * ldh;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) rr[i] += hr[i];
    rms_norm_row(rr, n, weight, eps, y + r * n);
  }
  return OPS_OK;
}

extern "C" int ops_rotary_f32(float* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv,
                              const float* cos, const float* sin) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 || ldv < heads * head_dim) return OPS_ERR_SHAPE;
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * heads * head_dim >= kParallelWork) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* __restrict c = cos + t * head_dim;
    const float* __restrict s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* __restrict a = v + t * ldv + h * head_dim;
      float* __restrict b = a + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float lo = a[i], hi = b[i];
        a[i] = lo * c[i] - hi * s[i];
        b[i] = hi * c[half + i] + lo * s[half + i];
      }
    }
  }
  return OPS_OK;
}

extern "C" int ops_silu_mul_f32(const float* gate, const float* up, int64_t rows, int64_t n, int64_t ld,
                                float* out) {
  if (rows < 0 || n < 0 || ld < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict g = gate + r * ld;
    const float* __restrict u = up + r * ld;
    float* __restrict o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + exp_clamped(-g[i])) * u[i];
  }
  return OPS_OK;
}

extern "C" int ops_argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, int64_t* out) {
  if (rows < 0 || n <= 0 || ldx < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kArgmaxParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * ldx, n);
  return OPS_OK;
}
