// bf16 GEMM for a bfloat16 model's linear layers on the CPU: y = x @ w (+ bias), x, w and y in bf16.
//
// torch's bf16 matmul on the CPU (oneDNN) reorders the weight on every call: for the few rows of a decode step it
// ran 3-6x above the step's weight-streaming floor, slower than the fp32 model it halves the bytes of. Here the
// weight is packed once into the greedy screen's bf16 panels (cpu/bf16_panels.h) and multiplied by AVX512-BF16
// dot products (VDPBF16PS: each product exact, summed in fp32), each output rounded once to bf16 (nearest even),
// as torch rounds its fp32 sums. Processors without AVX512-BF16: sg_bf16_available() is 0 and the callers keep
// torch's GEMM.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 1 where sg_bf16_gemm runs (AVX512-BF16), else 0.
int sg_bf16_available(void);

// uint16 values the packed form of a (K, N) weight takes.
int64_t sg_bf16_packed_size(int64_t K, int64_t N);

// w: a (K, N) bf16 weight, element (k, n) at w[k * stride_k + n * stride_n] (an nn.Linear's (N, K) weight as it
// is: stride_k 1, stride_n K; no copy) -> packed (sg_bf16_packed_size values, the bits unchanged).
int sg_bf16_pack(const uint16_t* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, uint16_t* packed);

// y (M, N contiguous, bf16) = x (M, K bf16, row stride ldx) @ w + bias (N fp32 values, or NULL), summed in fp32
// and rounded once. SG_ERR_UNSUPPORTED without AVX512-BF16.
int sg_bf16_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed, int64_t N,
                 const float* bias, uint16_t* y);

#ifdef __cplusplus
}
#endif
