// Skinny GEMM for decode steps on the CPU: y = x @ w (+ bias) for few rows of x.
//
// The weight is packed once, at load time, into column panels: for each tile of SG_TILE output columns, its
// (K x SG_TILE) slice stored contiguously (zero-padded past N). A decode step has as many rows as running
// sequences (1..32), where general-purpose GEMMs spend much of their time packing the weight on every call;
// this kernel streams each packed panel once from memory and keeps it in L2 while every row block of x uses it.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { SG_OK = 0, SG_ERR_UNSUPPORTED = 1, SG_ERR_SHAPE = 2 };
#define SG_TILE 64

// Floats the packed form of a (K, N) weight takes: ceil(N / SG_TILE) * K * SG_TILE.
int64_t sg_packed_size(int64_t K, int64_t N);

// w: (K, N) row-major (input-major) -> packed (sg_packed_size floats).
int sg_pack_f32(const float* w, int64_t K, int64_t N, float* packed);

// The same from any layout: element (k, n) at w[k * stride_k + n * stride_n] (an nn.Linear's (N, K) weight as it
// is: stride_k 1, stride_n K), without a transposed copy of it.
int sg_pack_f32_strided(const float* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n, float* packed);

// y = x @ w + bias. x: (M, K) with row stride ldx (elements); packed: from sg_pack_f32; bias: (N,) or NULL;
// y: (M, N) contiguous. Returns SG_ERR_UNSUPPORTED when built without AVX-512 or AVX2+FMA (the caller uses its
// own GEMM).
int sg_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                const float* bias, float* y);

// Columns cols[0..count) of x @ w for one row x (K floats), without bias, into out: bitwise the values
// sg_gemm_f32 computes for them (the LM head's greedy screen, greedy_screen.h, recomputes its candidates so).
// Reads K values of the packed panel per column, one cache line each.
int sg_dot_columns(const float* x, int64_t K, const float* packed, int64_t N, const int32_t* cols, int64_t count,
                   float* out);

// k rows of each packed panel one pass of sg_gemm_f32 walks (the rest of the panel waits for the next pass):
// chosen when the library loads, from the processor's L1 data cache (skinny_gemm_cpu.cpp says why). `rows` > 0
// sets it for the calls that follow (tests and benchmarks compare choices in one process); 0 only asks.
int64_t sg_chunk_rows(int64_t rows);

// Bytes ahead of its loads that a walk with one block of x's rows (M <= 6) prefetches the weights; 0 makes it
// fetch the next chunk as the walks of more rows do (skinny_gemm_cpu.cpp says why). `bytes` >= 0 sets it for the
// calls that follow (tests and benchmarks); negative only asks.
int64_t sg_stream_ahead(int64_t bytes);

#ifdef __cplusplus
}
#endif
