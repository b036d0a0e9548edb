// Greedy screen for the LM head on the CPU: the argmax of fp32 logits from a bf16 pass, exactly.
//
// A greedy step needs only each row's largest logit. gs_screen computes every logit from bf16 copies of x and of
// the head's weight (AVX512-BF16 dot products: half the bytes and twice the products per instruction of the fp32
// GEMM), each within a proven bound B of the value the fp32 skinny GEMM computes (sg_gemm_f32, bitwise). With x^,
// w^ the bf16 roundings and dx = x - x^, dw = w - w^ (both known exactly):
//
//   x.w - x^.w^ = x^.dw + dx.w^ + dx.dw, so
//   B = ||x^|| max||dw_j|| + ||dx|| max||w^_j|| + ||dx|| max||dw_j||          (Cauchy-Schwarz)
//       + gamma_K ||x^|| max||w^_j|| + gamma_K ||x|| max||w_j||             (the bf16 and fp32 sums' rounding)
//       + a negligible term for bf16's flushed denormals,   gamma_K = K 2^-23 / (1 - K 2^-23).
//
// After the caller masks tokens (-inf), gs_refine recomputes in fp32, with sg_dot_columns, every logit within 2B of
// its row's largest approximate one. No other logit can be the row's fp32 maximum (each is below approx_max - B
// <= exact_max), so an argmax over the refined row is the argmax of the fp32 GEMM's logits, ties included; its
// value is the fp32 one. Rows whose x is not finite, or large enough to overflow, are computed in fp32 whole by
// gs_screen.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The path gs_screen takes: 2 with AVX512-BF16 (VDPBF16PS); 1 with AVX2+FMA only, the bf16 weights widened to
// fp32 in registers and multiplied with x unrounded (the bound still holds: dx = 0; as many FMAs as the fp32 GEMM,
// so slower than it from a few rows); 0 for neither (gs_screen refuses).
int gs_available(void);

// on > 0: path 1 even where path 2 could run (tests); 0: back to the processor's best; < 0 only asks.
int gs_widen_only(int on);

// uint16 values the screen's copy of a (K, N) weight takes.
int64_t gs_packed_size(int64_t K, int64_t N);

// w: a (K, N) fp32 weight, element (k, n) at w[k * stride_k + n * stride_n] (an nn.Linear's (N, K) weight as it
// is: stride_k 1, stride_n K; no copy) -> packed bf16 panels (gs_packed_size values, rounded to nearest even) and
// norms[3]: the largest column norms of w, w^ and dw, rounded up. SG_ERR_SHAPE for a non-finite weight.
int gs_pack(const float* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, uint16_t* packed,
            double* norms);

// y (M, N contiguous) = approximate logits of x (M, K; row stride ldx) within B of sg_gemm_f32's; rows that are
// not safe to approximate get sg_gemm_f32's values (packed_f32: sg_pack_f32's form of the same weight).
int gs_screen(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed, const float* packed_f32,
              const double* norms, int64_t N, float* y);

// After masks (-inf entries stay as they are): each safe row's logits within 2B of its largest become
// sg_gemm_f32's values (a row whose largest value is not finite, all masked or NaN, stays as it is). Returns how
// many were recomputed, or -SG_ERR_SHAPE.
int64_t gs_refine(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed_f32,
                  const double* norms, int64_t N, float* y);

#ifdef __cplusplus
}
#endif
