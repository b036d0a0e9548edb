// Greedy screen for a bf16 model's LM head on the CPU: the argmax of the bf16 GEMM's logits from an int8 pass,
// exactly.
//
// A greedy step needs only each row's largest logit. gq_screen computes every logit from int8 copies of x and of
// the head's weight (AVX512-VNNI: a quarter of the fp32 bytes, half the bf16 GEMM's, and twice its products per
// instruction), each within a proven bound B of the value the bf16 GEMM (sg_bf16_gemm) gives. Each weight column
// n is w_n = s_n q_n + dw_n (q_n int8, s_n = max|w_n| / 127), each row x = a q_x + dx (a = max|x| / 127); the
// residuals are known exactly, and the int32 sums are exact. With A_n the approximation and r_n the bf16 GEMM's
// value (a chain of fp32 VDPBF16PS sums rounded once to bf16):
//
//   x.w_n - a s_n q_x.q_n = a q_x.dw_n + dx.(s_n q_n) + dx.dw_n                              (exact)
//   E_n = ||a q_x|| ||dw_n|| + ||dx|| ||s_n q_n|| + ||dx|| ||dw_n||                           (Cauchy-Schwarz)
//         + gamma_K ||x|| max||w_j|| + K 2^-120 (2 + ||x|| + max||w_j||) (the chain's rounding and flushed denormals)
//   |r_n - A_n| <= B_n = 1.01 (E_n (1 + 2^-8) + L (2^-8 + 2^-20)) + 2^-90,
//
// L the largest finite |A_j| of the row (A_n's own fp32 rounding: 2^-21 |A_n|; the bf16 rounding of r_n: 2^-8;
// 2^-90 for a s_n underflowing). After the caller masks tokens (-inf), gq_refine recomputes, bitwise as the bf16
// GEMM (the same VDPBF16PS chain over the pairs in order, rounded to bf16 and widened), every logit with
// A_n + B_n >= max_j (A_j - B_j), a lower bound of the row's largest exact logit, reading the weight's (N, K)
// rows. No other logit can reach the row's maximum: an argmax over the refined row is the bf16 GEMM's, ties
// included. The norms are each column's: on random weights a third of the candidates the largest norms give.
// Rows whose x is not finite, all zero, or large enough to overflow are the bf16 GEMM's whole (gq_screen computes
// them with it).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 1 where the processor has AVX512-VNNI and AVX512-BF16 (and this build has the code), else 0.
int gq_available(void);

// Bytes of the screen's int8 panels of a (K, N) weight.
int64_t gq_packed_size(int64_t K, int64_t N);

// w: a (K, N) bf16 weight (bits), element (k, n) at w[k * stride_k + n * stride_n] (an nn.Linear's (N, K) weight
// as it is: stride_k 1, stride_n K) -> int8 panels (gq_packed_size bytes), scales[N] (s_n), sums[N] (the sum of
// q_n), norms[3]: the largest column norms of w, of s q and of dw, and col_norms[2N]: ||dw_n|| then ||s_n q_n||,
// all rounded up. SG_ERR_SHAPE for a non-finite weight or K past 65,536 (the int32 sums' range).
int gq_pack(const uint16_t* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, int8_t* packed,
            float* scales, int32_t* sums, double* norms, float* col_norms);

// y (M, N contiguous, fp32) = approximate logits of x (M, K bf16; row stride ldx) within B of sg_bf16_gemm's;
// rows that are not safe to approximate get sg_bf16_gemm's values (packed_bf16: sg_bf16_pack's form of the same
// weight), widened.
int gq_screen(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const int8_t* packed, const float* scales,
              const int32_t* sums, const uint16_t* packed_bf16, const double* norms, int64_t N, float* y);

// After masks (-inf entries stay as they are): each safe row's logits that could be its largest (above) become
// sg_bf16_gemm's values, computed from `rows` (the weight as (N, K) bf16 rows, row stride ld_rows). A row whose
// largest value is not finite (all masked, or NaN) stays as it is. Returns how many were recomputed, or
// -SG_ERR_SHAPE.
int64_t gq_refine(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* rows, int64_t ld_rows,
                  const double* norms, const float* col_norms, int64_t N, float* y);

// bounds[N]: B_n for one row of x (K bf16 values), `largest` its logits' largest finite magnitude (tests check
// the bound against the GEMM). SG_ERR_SHAPE where the row is not safe to approximate.
int gq_bounds(const uint16_t* x, int64_t K, const double* norms, const float* col_norms, int64_t N, double largest,
              float* bounds);

#ifdef __cplusplus
}
#endif
