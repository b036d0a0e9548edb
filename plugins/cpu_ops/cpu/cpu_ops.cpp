// Fused CPU ops, fp32 and (for a bf16 model's layers) bf16 (see include/cpu_ops.h). Loops are written for the
// compiler's vectoriser (omp simd) and split over rows with OpenMP only when there is enough work to pay for waking
// the threads.
#include "cpu_ops.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

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

// Element types: fp32 as it is; bf16 (its bits in a uint16_t) widened to fp32, each op computing in fp32 and
// rounding where torch's module path (models/llama.py) rounds on bf16 tensors: the residual sum, the normalised
// row before the weight, each rotary product and their sum, silu before the product. Rounding is to nearest even,
// NaN kept (the bf16 GEMM's).
inline float widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <typename T> struct Elem;
template <> struct Elem<float> {  // no rounding: the fp32 expressions as they read
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};
template <> struct Elem<uint16_t> {
  static float load(uint16_t b) { return widen(b); }
  static uint16_t store(float f) { return narrow(f); }
  static float round(float f) { return widen(narrow(f)); }
};

// A bf16 row widened to fp32, the calling thread's (kept between calls: no allocation once grown).
inline float* widened_row(int64_t n) {
  static thread_local std::vector<float> row;
  if (int64_t(row.size()) < n) row.resize(n);
  return row.data();
}

// One row of RMSNorm over x (fp32 values): y = weight * round(x / sqrt(mean(x^2) + eps)), as transformers' in the
// model's dtype.
template <typename T>
inline void rms_norm_row(const float* __restrict x, int64_t n, const T* __restrict weight, float eps,
                         T* __restrict y) {
  using E = Elem<T>;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / float(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = E::store(E::load(weight[i]) * E::round(x[i] * inv));
}

template <typename T>
int rms_norm(const T* x, int64_t rows, int64_t n, int64_t ldx, const T* weight, float eps, T* y) {
  constexpr bool wide = std::is_same<T, float>::value;
  if (rows < 0 || n <= 0 || ldx < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (wide) {
      rms_norm_row(x + r * ldx, n, weight, eps, y + r * n);
    } else {
      float* row = widened_row(n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = widen(x[r * ldx + i]);
      rms_norm_row(row, n, weight, eps, y + r * n);
    }
  }
  return OPS_OK;
}

// residual += h (rounded to T), then the row's RMSNorm: fp32 rows in place, bf16 ones through an fp32 copy.
template <typename T>
int add_rms_norm(T* residual, const T* h, int64_t rows, int64_t n, int64_t ldr, int64_t ldh, const T* weight,
                 float eps, T* y) {
  constexpr bool wide = std::is_same<T, float>::value;
  if (rows < 0 || n <= 0 || ldr < n || ldh < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* __restrict rr = residual + r * ldr;
    const T* __restrict hr = h + r * ldh;
    if constexpr (wide) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += hr[i];
      rms_norm_row(rr, n, weight, eps, y + r * n);
    } else {
      float* row = widened_row(n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        row[i] = Elem<T>::round(widen(rr[i]) + widen(hr[i]));
        rr[i] = narrow(row[i]);
      }
      rms_norm_row(row, n, weight, eps, y + r * n);
    }
  }
  return OPS_OK;
}

template <typename T>
int silu_mul(const T* gate, const T* up, int64_t rows, int64_t n, int64_t ld, T* out) {
  using E = Elem<T>;
  if (rows < 0 || n < 0 || ld < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict g = gate + r * ld;
    const T* __restrict u = up + r * ld;
    T* __restrict o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float x = E::load(g[i]);
      o[i] = E::store(E::round(x / (1.f + exp_clamped(-x))) * E::load(u[i]));
    }
  }
  return OPS_OK;
}

}  // namespace

extern "C" int ops_rms_norm_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, const float* weight,
                                float eps, float* y) {
  return rms_norm(x, rows, n, ldx, weight, eps, y);
}

extern "C" int ops_add_rms_norm_f32(float* residual, const float* h, int64_t rows, int64_t n, int64_t ldr,
                                    int64_t ldh, const float* weight, float eps, float* y) {
  return add_rms_norm(residual, h, rows, n, ldr, ldh, weight, eps, y);
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
  return silu_mul(gate, up, rows, n, ld, out);
}

extern "C" int ops_argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, int64_t* out) {
  if (rows < 0 || n <= 0 || ldx < n) return OPS_ERR_SHAPE;
#pragma omp parallel for if (rows * n >= kArgmaxParallelWork) schedule(static)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * ldx, n);
  return OPS_OK;
}

extern "C" int ops_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ldx, const uint16_t* weight,
                                 float eps, uint16_t* y) {
  return rms_norm(x, rows, n, ldx, weight, eps, y);
}

extern "C" int ops_add_rms_norm_bf16(uint16_t* residual, const uint16_t* h, int64_t rows, int64_t n, int64_t ldr,
                                     int64_t ldh, const uint16_t* weight, float eps, uint16_t* y) {
  return add_rms_norm(residual, h, rows, n, ldr, ldh, weight, eps, y);
}

// (Not one template with the fp32 rotary: its products and sums are left to the compiler to fuse, these are rounded
// one by one, as torch's bf16 ops round them.)
extern "C" int ops_rotary_bf16(uint16_t* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv,
                               const uint16_t* cos, const uint16_t* sin) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 || ldv < heads * head_dim) return OPS_ERR_SHAPE;
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * heads * head_dim >= kParallelWork) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* __restrict c = cos + t * head_dim;
    const uint16_t* __restrict s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* __restrict a = v + t * ldv + h * head_dim;
      uint16_t* __restrict b = a + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {  // x * cos + rotate_half(x) * sin, each product and sum rounded
        using E = Elem<uint16_t>;
        const float lo = widen(a[i]), hi = widen(b[i]);
        a[i] = narrow(E::round(lo * widen(c[i])) + E::round(-hi * widen(s[i])));
        b[i] = narrow(E::round(hi * widen(c[half + i])) + E::round(lo * widen(s[half + i])));
      }
    }
  }
  return OPS_OK;
}

extern "C" int ops_silu_mul_bf16(const uint16_t* gate, const uint16_t* up, int64_t rows, int64_t n, int64_t ld,
                                 uint16_t* out) {
  return silu_mul(gate, up, rows, n, ld, out);
}
