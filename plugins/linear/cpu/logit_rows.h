// Scans over one row of logits, shared by the greedy screens (greedy_screen_cpu.cpp, int8_screen_cpu.cpp): the
// row's largest value and the columns at or above a threshold, 16 lanes at a time where AVX-512 runs.
#pragma once
#include <math.h>
#include <stdint.h>

#include <vector>

#include "bf16_panels.h"  // GS_BUILD, GS_TARGET

namespace inflight::logits {

#ifdef GS_BUILD
GS_TARGET inline float row_max_512(const float* y, int64_t N) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 v = _mm512_loadu_ps(y + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_maskz_max_ps((__mmask16)0xFFFF, top, v);
  }
  float lanes[16], m = -INFINITY;
  _mm512_storeu_ps(lanes, top);
  for (float v : lanes) m = v > m ? v : m;
  for (; j < N; ++j) m = y[j] > m || y[j] != y[j] ? y[j] : m;
  return nan ? NAN : m;
}

GS_TARGET inline void at_or_above_512(const float* y, int64_t N, float threshold, std::vector<int32_t>* cols) {
  const __m512 t = _mm512_set1_ps(threshold);
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 v = _mm512_loadu_ps(y + j);
    for (unsigned m = _mm512_cmp_ps_mask(v, t, _CMP_NLT_UQ); m; m &= m - 1)  // >=, or NaN
      cols->push_back((int32_t)(j + __builtin_ctz(m)));
  }
  for (; j < N; ++j)
    if (!(y[j] < threshold)) cols->push_back((int32_t)j);
}

GS_TARGET inline float largest_finite_512(const float* y, int64_t N) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 top = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(y + j));
    top = _mm512_mask_max_ps(top, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), top, a);  // not inf, not NaN
  }
  float lanes[16], m = 0.0f;
  _mm512_storeu_ps(lanes, top);
  for (float v : lanes) m = v > m ? v : m;
  for (; j < N; ++j) {
    const float a = fabsf(y[j]);
    m = a < INFINITY && a > m ? a : m;
  }
  return m;
}

inline bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}
#endif

// The row's largest value (NaN if it holds one).
inline float row_max(const float* y, int64_t N) {
#ifdef GS_BUILD
  if (has_avx512()) return row_max_512(y, N);
#endif
  float m = -INFINITY;
  for (int64_t j = 0; j < N; ++j) m = y[j] > m || y[j] != y[j] ? y[j] : m;
  return m;
}

// The columns at or above `threshold`, or NaN, in order.
inline void at_or_above(const float* y, int64_t N, float threshold, std::vector<int32_t>* cols) {
#ifdef GS_BUILD
  if (has_avx512()) return at_or_above_512(y, N, threshold, cols);
#endif
  for (int64_t j = 0; j < N; ++j)
    if (!(y[j] < threshold)) cols->push_back((int32_t)j);
}

// The largest magnitude among the row's finite values (0 if none).
inline double largest_finite(const float* y, int64_t N) {
#ifdef GS_BUILD
  if (has_avx512()) return largest_finite_512(y, N);
#endif
  float m = 0.0f;
  for (int64_t j = 0; j < N; ++j) {
    const float a = fabsf(y[j]);
    m = a < INFINITY && a > m ? a : m;
  }
  return m;
}

}  // namespace inflight::logits
