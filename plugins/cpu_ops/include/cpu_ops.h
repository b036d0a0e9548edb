// Fused fp32 CPU ops for a Llama decoder step: the work between the GEMMs, one pass over memory each instead
// of the 3-6 small torch ops (and their dispatch) that compute the same thing. Arrays are row-major; `ld*`
// are row strides in elements. Every function returns OPS_OK or OPS_ERR_SHAPE.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { OPS_OK = 0, OPS_ERR_SHAPE = 1 };

// y[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r < rows of n values (Llama's RMSNorm, fp32
// throughout). y: (rows, n) contiguous.
int ops_rms_norm_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, const float* weight, float eps,
                     float* y);

// The residual add and the next RMSNorm in one pass: residual[r] += h[r] in place, then y[r] = RMSNorm of the
// updated residual[r] as ops_rms_norm_f32. residual, h: (rows, n) with row strides ldr, ldh; y contiguous.
int ops_add_rms_norm_f32(float* residual, const float* h, int64_t rows, int64_t n, int64_t ldr, int64_t ldh,
                         const float* weight, float eps, float* y);

// Rotary embedding, rotate-half form, in place on every head of every token: with h = head_dim / 2,
// v[i] <- v[i] cos[i] - v[i + h] sin[i] and v[i + h] <- v[i + h] cos[i + h] + v[i] sin[i + h] (i < h).
// v: (tokens, heads, head_dim) with token stride ldv and contiguous heads; cos, sin: (tokens, head_dim).
int ops_rotary_f32(float* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv, const float* cos,
                   const float* sin);

// out[r] = silu(gate[r]) * up[r] elementwise (SwiGLU's activation) for rows of n values; gate and up share the
// row stride ld (a merged gate/up projection's output: up = gate + n, ld = 2n); out: (rows, n) contiguous.
int ops_silu_mul_f32(const float* gate, const float* up, int64_t rows, int64_t n, int64_t ld, float* out);

// out[r] = the first index of the largest of x[r][0..n) (greedy sampling); a row holding NaN gets the first
// NaN's index, as torch.argmax does.
int ops_argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t ldx, int64_t* out);

// One sampled token for each of `count` rows, rows[j] of x: weights w_i = e^((x_i - max) / temperature[j]) (fp32),
// zero where below min_p[j] (in [0, 1]; vLLM's min_p: w_i is the token's probability over the best one's), kept
// for the top_k[j] largest x_i (0 or >= n: all; ties at the k-th value kept in index order), then for the
// smallest set of best tokens whose mass reaches top_p[j] of the kept total (>= 1: all; a token is kept when
// the mass of tokens strictly better than it is below that); out[j] = the first index whose running kept mass,
// in index order, exceeds uniform[j] (in [0, 1)) times the kept total: never a zero weight. out[j] = -1 where the
// row has a NaN or +inf, or nothing finite. Each row is computed by one thread in a fixed order, so a row's token
// does not depend on the other rows.
int ops_sample_rows_f32(const float* x, int64_t n, int64_t ldx, const int64_t* rows, int64_t count,
                        const float* temperature, const int64_t* top_k, const float* top_p, const float* min_p,
                        const double* uniform, int64_t* out);

// Log-probabilities (log_softmax in fp32, the sum of exponentials in double) of `count` rows of x, row j at
// x + rows[j] * ldx: logprob[j] = that of tokens[j]; the top[j] most likely tokens (0 <= top[j] <= max_top, ties by the
// lower index), best first, at top_ids[j * max_top] and top_logprobs[j * max_top]. ok[j] = 0 where row j holds a
// NaN or +inf (its outputs are not written; torch's log_softmax gives NaN there), else 1. One thread a row.
int ops_logprobs_rows_f32(const float* x, int64_t n, int64_t ldx, const int64_t* rows, int64_t count,
                          const int64_t* tokens,
                          const int64_t* top, int64_t max_top, float* logprob, int64_t* top_ids, float* top_logprobs,
                          int32_t* ok);

// The same four ops for a bfloat16 model (values are bf16 bits): computed in fp32, rounded to bf16 where torch's
// ops on bf16 tensors round (models/llama.py): the residual sum; the normalised row, then its product with the
// weight; each rotary product and their sum; silu(gate), then its product with up.
int ops_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ldx, const uint16_t* weight, float eps,
                      uint16_t* y);
int ops_add_rms_norm_bf16(uint16_t* residual, const uint16_t* h, int64_t rows, int64_t n, int64_t ldr, int64_t ldh,
                          const uint16_t* weight, float eps, uint16_t* y);
int ops_rotary_bf16(uint16_t* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv, const uint16_t* cos,
                    const uint16_t* sin);
int ops_silu_mul_bf16(const uint16_t* gate, const uint16_t* up, int64_t rows, int64_t n, int64_t ld,
                      uint16_t* out);

#ifdef __cplusplus
}
#endif
