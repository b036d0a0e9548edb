// e^x in fp32 written for the compiler's vectoriser (std::exp is a library call it will not vectorise), shared
// by the CPU kernels: 2^(x log2 e) as 2^n * 2^f with a degree-6 polynomial for 2^f, f in [-0.5, 0.5];
// relative error ~2e-7.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace inflight {

// x clamped to [-87, 88], where 2^n stays a normal float: e^-87 ~ 1.6e-38 stands in for anything smaller,
// e^88 ~ 1.7e38 for anything larger.
inline float exp_clamped(float x) {
  const float y = std::min(std::max(x, -87.f), 88.f) * 1.44269504088896341f;
  const float n = std::nearbyint(y), f = y - n;
  float r = 1.53552577e-4f;
  r = r * f + 1.33988708e-3f;
  r = r * f + 9.61808753e-3f;
  r = r * f + 5.55034615e-2f;
  r = r * f + 2.40226486e-1f;
  r = r * f + 6.93147182e-1f;
  r = r * f + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return r * scale;
}

// e^x for x <= 0, exactly 0 below -87 (under fp32's smallest normal), as a softmax over score gaps needs: not a
// denormal, and not 2^n with an invalid biased exponent (what clamping at -126 once produced: NaN for gaps > 87).
inline float exp_neg(float x) { return x > -87.f ? exp_clamped(x) : 0.f; }

}  // namespace inflight
