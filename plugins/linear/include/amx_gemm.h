// fp32 GEMM for prefill-sized inputs on AMX tiles: y = x @ w (+ bias), with fp32 accuracy from bf16 arithmetic.
//
// Each fp32 value v is split exactly into three bf16 pieces, v = hi + mid + lo (8 significant bits each, 24 in
// all, every residual exact in fp32). A product x * w then takes the six piece products whose weight is at least
// 2^-16 of hi * hi (hi*hi, hi*mid, mid*hi, hi*lo, mid*mid, lo*hi), each exact in fp32 and accumulated in fp32 by
// TDPBF16PS; what is left out is below fp32's own rounding of the product (the "bf16x6" scheme of Henry, Tang and
// Heinecke, "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision Computations", 2019).
// Six bf16 tile products run several times faster than AVX-512 fp32 FMAs, so from a few dozen rows on this beats
// the skinny GEMM; below that (decode steps) the skinny GEMM's 4 bytes of weight per value stream faster than
// these 6.
//
// The weight is packed once into the pieces in AMX's pair-interleaved layout; x is split on every call.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Rows from which callers should take this GEMM over sg_gemm_f32 (measured: benchmarks/skinny_gemm.py).
#define SG_AMX_MIN_ROWS 64
int sg_amx_min_rows(void);  // SG_AMX_MIN_ROWS, for callers outside C

// 1 when this process can run AMX tile code (the processor has AMX-TILE and AMX-BF16 with AVX-512, the library
// was compiled with them, and the kernel granted the tile state), else 0. Asks the kernel once.
int sg_amx_available(void);

// uint16 elements the packed form of a (K, N) weight takes: 3 pieces of ceil(K/32)*32 x ceil(N/32)*32.
int64_t sg_amx_packed_size(int64_t K, int64_t N);

// w: (K, N) row-major (input-major) fp32 -> packed (sg_amx_packed_size elements). SG_ERR_UNSUPPORTED without AMX.
int sg_amx_pack_f32(const float* w, int64_t K, int64_t N, uint16_t* packed);

// y = x @ w + bias. x: (M, K) with row stride ldx (elements); packed: from sg_amx_pack_f32; bias: (N,) or NULL;
// y: (M, N) contiguous. Returns SG_OK, SG_ERR_SHAPE or SG_ERR_UNSUPPORTED (skinny_gemm.h's codes).
int sg_amx_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed, int64_t N,
                    const float* bias, float* y);

#ifdef __cplusplus
}
#endif
