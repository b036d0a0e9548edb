// Fused CUDA ops for a Llama decoder step: the elementwise work between the GEMMs, one kernel each instead of the
// 3-8 small torch kernels that compute the same thing (on a GPU a batch-1,024 decode step of an 8B model spent
// ~10 ms in ~700 such kernels). Each rounds to the tensor's dtype wherever torch's modules do (models/llama.py:
// RMSNorm, apply_rotary, silu_mul), so bf16 results are torch's but for the RMSNorm's sum of squares, summed in
// another order. Arrays are row-major with row strides `ld*` in elements and contiguous rows; `stream` is a
// cudaStream_t. Every function returns COPS_OK, COPS_ERR_SHAPE, COPS_ERR_DTYPE or COPS_ERR_LAUNCH.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { COPS_OK = 0, COPS_ERR_SHAPE = 1, COPS_ERR_DTYPE = 2, COPS_ERR_LAUNCH = 3 };
enum { COPS_FLOAT32 = 0, COPS_BFLOAT16 = 1, COPS_FLOAT16 = 2 };

// With h: residual[r] = residual[r] + h[r] (rounded to dtype, in place), then y[r] = RMSNorm of it; without
// (h == NULL): y[r] = RMSNorm of residual[r], residual unchanged. RMSNorm as transformers': in fp32
// x / sqrt(mean(x^2) + eps), rounded to dtype, times weight, rounded. residual, h: (rows, n) with row strides
// ldr, ldh; weight: n values; y: (rows, n) contiguous.
int cops_add_rms_norm(int dtype, void* residual, const void* h, int64_t rows, int64_t n, int64_t ldr, int64_t ldh,
                      const void* weight, float eps, void* y, void* stream);

// Rotary embedding, rotate-half form, in place on every head of every token: with half = head_dim / 2, for i <
// half, v[i] <- v[i] cos[i] - v[i + half] sin[i] and v[i + half] <- v[i + half] cos[i + half] + v[i] sin[i + half],
// each product and the sum rounded to dtype (torch's `x * cos + rotate_half(x) * sin`). v: (tokens, heads,
// head_dim) with token stride ldv and contiguous heads; cos, sin: (tokens, head_dim) contiguous.
int cops_rotary(int dtype, void* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv, const void* cos,
                const void* sin, void* stream);

// out[r] = silu(gate[r]) * up[r] (SwiGLU's activation): silu in fp32 rounded to dtype, then the product rounded.
// gate and up share the row stride ld (a merged gate/up projection's output: up = gate + n, ld = 2n); out: (rows,
// n) contiguous.
int cops_silu_mul(int dtype, const void* gate, const void* up, int64_t rows, int64_t n, int64_t ld, void* out,
                  void* stream);

#ifdef __cplusplus
}
#endif
