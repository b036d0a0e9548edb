// Paged attention on CUDA.
//
// attention_rows_kernel (K/V rows 16-byte aligned, as every cache the engine allocates) and attention_kernel
// (any strides) compute the same thing, one CTA per (query token, group of query heads sharing a KV head,
// context partition); the first in three passes with no cross-lane reduction per key (see it below), 0.75-0.87x
// the second's time at Llama 3 8B's heads on an H200.
// attention_kernel: one CTA per (query token, group of query heads sharing a KV head, context partition).
// Its warps stride over the partition's keys a few at a time, walking the block table; lanes hold strided
// slices of the head dimension so loads coalesce. Each warp keeps an online softmax per head; the CTA merges its warps in shared
// memory. With several partitions (long contexts) each writes (max, sum, unnormalised output) to the
// workspace and reduce_kernel merges them. Partitions start at the token's first visible key, so with a
// sliding window the keys before it cost nothing and a window bounds the partitions. write_kv_kernel scatters
// new K/V into their slots.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "paged_attention.h"

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;
constexpr int kPartition = 512;  // keys per CTA before splitting the context

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(float x) { return x; }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float(float x) { return x; }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ int seq_of_token(const int32_t* qsl, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;  // last i with qsl[i] <= token
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qsl[mid] <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__host__ __device__ inline int num_partitions(const pa_params& p) {
  const int span = p.sliding_window > 0 && p.sliding_window < p.max_context_len ? p.sliding_window
                                                                                 : p.max_context_len;
  return (span + kPartition - 1) / kPartition;
}

// Workspace per (token, head, partition): max, sum, then head_size floats of unnormalised output.
__device__ __forceinline__ float* partial(float* ws, const pa_params& p, int token, int head, int part) {
  return ws + ((int64_t(token) * p.num_heads + head) * num_partitions(p) + part) * (p.head_size + 2);
}

// VEC = head_size / 32 values per lane; G = query heads per CTA (all sharing one KV head); C = keys per warp
// per pass (fewer where G * VEC values of q and output already fill the registers).
template <typename T, int VEC, int G, int C = (G * VEC <= 16 ? 4 : 2)>
__global__ void __launch_bounds__(kWarps * kWarp)
attention_kernel(pa_params p, const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                 const int32_t* __restrict__ block_tables, const int32_t* __restrict__ context_lens,
                 const int32_t* __restrict__ qsl, T* __restrict__ out, float* __restrict__ ws) {
  constexpr int D = VEC * kWarp;
  __shared__ float s_m[kWarps][G], s_l[kWarps][G];
  __shared__ float s_acc[kWarps][G][D];

  const int token = blockIdx.x, head0 = blockIdx.y * G, part = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int seq = seq_of_token(qsl, p.num_seqs, token);
  const int num_q = qsl[seq + 1] - qsl[seq];
  const int num_keys = context_lens[seq] - num_q + (token - qsl[seq]) + 1;  // causal within the chunk
  const int first = p.sliding_window > 0 ? max(0, num_keys - p.sliding_window) : 0;
  const int begin = first + part * kPartition, end = min(num_keys, begin + kPartition);
  const int kv_head = head0 / (p.num_heads / p.num_kv_heads);
  const int32_t* table = block_tables + int64_t(seq) * p.max_blocks_per_seq;

  float qr[G][VEC], acc[G][VEC], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* row = q + int64_t(token) * p.q_stride_token + int64_t(head0 + g) * p.q_stride_head;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      qr[g][v] = to_float(row[lane + v * kWarp]) * p.scale;
      acc[g][v] = 0.f;
    }
    m[g] = -FLT_MAX;
    l[g] = 0.f;
  }

  // Each warp takes C consecutive keys a pass: their block-table entries and K/V rows are all loaded before any
  // is used (C keys' loads in flight per warp, not one), their C scores per head are reduced side by side, and
  // the running max, sum and output are rescaled once a pass instead of once a key.
  for (int pos0 = begin + warp * C; pos0 < end; pos0 += kWarps * C) {
    float kr[C][VEC], vr[C][VEC];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int pos = min(pos0 + c, end - 1);  // past the end: a repeat of the last key, weighted 0 below
      const int64_t base = int64_t(table[pos / p.block_size]) * p.kv_stride_block +
                           int64_t(pos % p.block_size) * p.kv_stride_token + int64_t(kv_head) * p.kv_stride_head;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        kr[c][v] = to_float(kc[base + lane + v * kWarp]);
        vr[c][v] = to_float(vc[base + lane + v * kWarp]);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[C];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        s[c] = 0.f;
#pragma unroll
        for (int v = 0; v < VEC; ++v) s[c] += qr[g][v] * kr[c][v];
      }
#pragma unroll
      for (int offset = kWarp / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int c = 0; c < C; ++c) s[c] += __shfl_xor_sync(0xffffffffu, s[c], offset);
      }
      float m_new = m[g];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        if (pos0 + c < end) m_new = fmaxf(m_new, s[c]);
      }
      const float alpha = expf(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[g][v] *= alpha;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float w = pos0 + c < end ? expf(s[c] - m_new) : 0.f;
        l[g] += w;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[g][v] += w * vr[c][v];
      }
      m[g] = m_new;
    }
  }

#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = l[g];
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) s_acc[warp][g][lane + v * kWarp] = acc[g][v];
  }
  __syncthreads();

  const bool split = gridDim.z > 1;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float mx = -FLT_MAX;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float sum = 0.f, o = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float scale = s_l[w][g] > 0.f ? expf(s_m[w][g] - mx) : 0.f;
      sum += s_l[w][g] * scale;
      o += s_acc[w][g][d] * scale;
    }
    if (split) {
      float* dst = partial(ws, p, token, head0 + g, part);
      if (d == 0) {
        dst[0] = mx;
        dst[1] = sum;  // 0 when this partition lies past the sequence's keys
      }
      dst[2 + d] = o;
    } else {
      out[int64_t(token) * p.out_stride_token + int64_t(head0 + g) * p.out_stride_head + d] =
          from_float<T>(o / sum);
    }
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// 16 bytes at p (16-byte aligned) as floats: 8 bf16/fp16 values or 4 fp32.
template <typename T>
__device__ __forceinline__ void load16(const T* __restrict__ p, float (&out)[16 / sizeof(T)]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  T vals[16 / sizeof(T)];
  memcpy(vals, &raw, 16);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) out[i] = to_float(vals[i]);
}

// The same CTAs and results as attention_kernel, in three passes over the partition's (at most kPartition)
// keys, with no reduction across lanes per key: (1) each thread takes whole keys, reading its key's K row in
// 16-byte loads and dotting it with the G query heads held in shared memory, and keeps the scores in shared
// memory; (2) the heads' maxima and the softmax weights and their sums, over the CTA; (3) the warps split the
// keys and the lanes the head dimension to accumulate V. For K/V caches whose rows are 16-byte aligned.
template <typename T, int VEC, int G>
__global__ void __launch_bounds__(kWarps * kWarp)
attention_rows_kernel(pa_params p, const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                      const int32_t* __restrict__ block_tables, const int32_t* __restrict__ context_lens,
                      const int32_t* __restrict__ qsl, T* __restrict__ out, float* __restrict__ ws) {
  constexpr int D = VEC * kWarp, VW = 16 / sizeof(T), kThreads = kWarps * kWarp;
  __shared__ __align__(16) float s_q[G][D];
  __shared__ float s_w[G][kPartition];
  __shared__ float s_red[kWarps][G];
  __shared__ float s_acc[kWarps][G][D];

  const int token = blockIdx.x, head0 = blockIdx.y * G, part = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int seq = seq_of_token(qsl, p.num_seqs, token);
  const int num_q = qsl[seq + 1] - qsl[seq];
  const int num_keys = context_lens[seq] - num_q + (token - qsl[seq]) + 1;  // causal within the chunk
  const int first = p.sliding_window > 0 ? max(0, num_keys - p.sliding_window) : 0;
  const int begin = first + part * kPartition, n = min(num_keys, begin + kPartition) - begin;  // n <= 0: none
  const int kv_head = head0 / (p.num_heads / p.num_kv_heads);
  const int32_t* table = block_tables + int64_t(seq) * p.max_blocks_per_seq;
  auto row = [&](int pos) {
    return int64_t(table[pos / p.block_size]) * p.kv_stride_block + int64_t(pos % p.block_size) * p.kv_stride_token +
           int64_t(kv_head) * p.kv_stride_head;
  };

  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    s_q[g][d] = to_float(q[int64_t(token) * p.q_stride_token + int64_t(head0 + g) * p.q_stride_head + d]) * p.scale;
  }
  __syncthreads();

  float m[G];
#pragma unroll
  for (int g = 0; g < G; ++g) m[g] = -FLT_MAX;
  for (int i = threadIdx.x; i < n; i += kThreads) {  // (1) scores
    const T* k = kc + row(begin + i);
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += VW) {
      float kv[VW];
      load16(k + d0, kv);
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int j = 0; j < VW; ++j) s[g] += s_q[g][d0 + j] * kv[j];
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      s_w[g][i] = s[g];
      m[g] = fmaxf(m[g], s[g]);
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float x = warp_max(m[g]);
    if (lane == 0) s_red[warp][g] = x;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = s_red[0][g];
    for (int w = 1; w < kWarps; ++w) m[g] = fmaxf(m[g], s_red[w][g]);
  }
  __syncthreads();  // s_red is reused below

  float l[G];  // (2) weights
#pragma unroll
  for (int g = 0; g < G; ++g) l[g] = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float w = expf(s_w[g][i] - m[g]);
      s_w[g][i] = w;
      l[g] += w;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float x = warp_sum(l[g]);
    if (lane == 0) s_red[warp][g] = x;
  }
  __syncthreads();  // the weights and the sums are all in shared memory
#pragma unroll
  for (int g = 0; g < G; ++g) {
    l[g] = 0.f;
    for (int w = 0; w < kWarps; ++w) l[g] += s_red[w][g];
  }

  float acc[G][VEC];  // (3) V
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[g][v] = 0.f;
  }
#pragma unroll 4
  for (int i = warp; i < n; i += kWarps) {
    const T* v_row = vc + row(begin + i);
    float vr[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) vr[v] = to_float(v_row[lane + v * kWarp]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float w = s_w[g][i];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[g][v] += w * vr[v];
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) s_acc[warp][g][lane + v * kWarp] = acc[g][v];
  }
  __syncthreads();

  const bool split = gridDim.z > 1;
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += s_acc[w][g][d];
    if (split) {
      float* dst = partial(ws, p, token, head0 + g, part);
      if (d == 0) {
        dst[0] = m[g];
        dst[1] = l[g];  // 0 when this partition lies past the sequence's keys
      }
      dst[2 + d] = o;
    } else {
      out[int64_t(token) * p.out_stride_token + int64_t(head0 + g) * p.out_stride_head + d] = from_float<T>(o / l[g]);
    }
  }
}

template <typename T>
__global__ void reduce_kernel(pa_params p, T* __restrict__ out, const float* __restrict__ ws) {
  const int token = blockIdx.x, head = blockIdx.y;
  const int parts = num_partitions(p);
  float mx = -FLT_MAX;
  for (int i = 0; i < parts; ++i) {
    const float* src = partial(const_cast<float*>(ws), p, token, head, i);
    if (src[1] > 0.f) mx = fmaxf(mx, src[0]);
  }
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    float sum = 0.f, o = 0.f;
    for (int i = 0; i < parts; ++i) {
      const float* src = partial(const_cast<float*>(ws), p, token, head, i);
      if (src[1] > 0.f) {
        const float scale = expf(src[0] - mx);
        sum += src[1] * scale;
        o += src[2 + d] * scale;
      }
    }
    out[int64_t(token) * p.out_stride_token + int64_t(head) * p.out_stride_head + d] = from_float<T>(o / sum);
  }
}

template <typename T>
__global__ void write_kv_kernel(pa_params p, const T* __restrict__ k, const T* __restrict__ v, int64_t st,
                                int64_t sh, const int64_t* __restrict__ slots, T* __restrict__ kc,
                                T* __restrict__ vc) {
  const int token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0) return;
  const int64_t base = (slot / p.block_size) * p.kv_stride_block + (slot % p.block_size) * p.kv_stride_token;
  for (int i = threadIdx.x; i < p.num_kv_heads * p.head_size; i += blockDim.x) {
    const int h = i / p.head_size, d = i % p.head_size;
    kc[base + h * p.kv_stride_head + d] = k[token * st + h * sh + d];
    vc[base + h * p.kv_stride_head + d] = v[token * st + h * sh + d];
  }
}

template <typename T, int VEC, int G>
int launch_attention(const pa_params& p, const void* q, const void* kc, const void* vc, const int32_t* bt,
                     const int32_t* cl, const int32_t* qsl, void* out, float* ws, cudaStream_t stream) {
  const int parts = num_partitions(p);
  const dim3 grid(p.num_tokens, p.num_heads / G, parts);
  constexpr int64_t kVW = 16 / sizeof(T);  // 16-byte rows for attention_rows_kernel's loads
  const bool rows_aligned = reinterpret_cast<uintptr_t>(kc) % 16 == 0 && reinterpret_cast<uintptr_t>(vc) % 16 == 0 &&
                            p.kv_stride_block % kVW == 0 && p.kv_stride_token % kVW == 0 && p.kv_stride_head % kVW == 0;
  if (rows_aligned) {
    attention_rows_kernel<T, VEC, G><<<grid, kWarps * kWarp, 0, stream>>>(
        p, static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), bt, cl, qsl,
        static_cast<T*>(out), ws);
  } else {
    attention_kernel<T, VEC, G><<<grid, kWarps * kWarp, 0, stream>>>(
        p, static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), bt, cl, qsl,
        static_cast<T*>(out), ws);
  }
  if (parts > 1) {
    reduce_kernel<T><<<dim3(p.num_tokens, p.num_heads), 128, 0, stream>>>(p, static_cast<T*>(out), ws);
  }
  return cudaGetLastError() == cudaSuccess ? PA_OK : PA_ERR_LAUNCH;
}

template <typename T, int VEC>
int dispatch_group(const pa_params& p, const void* q, const void* kc, const void* vc, const int32_t* bt,
                   const int32_t* cl, const int32_t* qsl, void* out, float* ws, cudaStream_t s) {
  const int group = p.num_heads / p.num_kv_heads;  // heads per CTA: the largest of 8, 4, 2, 1 dividing it
  if (group % 8 == 0) return launch_attention<T, VEC, 8>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
  if (group % 4 == 0) return launch_attention<T, VEC, 4>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
  if (group % 2 == 0) return launch_attention<T, VEC, 2>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
  return launch_attention<T, VEC, 1>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
}

template <typename T>
int dispatch_head(const pa_params& p, const void* q, const void* kc, const void* vc, const int32_t* bt,
                  const int32_t* cl, const int32_t* qsl, void* out, float* ws, cudaStream_t s) {
  switch (p.head_size) {
    case 64: return dispatch_group<T, 2>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
    case 128: return dispatch_group<T, 4>(p, q, kc, vc, bt, cl, qsl, out, ws, s);
    default: return PA_ERR_SHAPE;
  }
}

int check(const pa_params* p) {
  if (p->dtype != PA_FLOAT32 && p->dtype != PA_BFLOAT16 && p->dtype != PA_FLOAT16) return PA_ERR_DTYPE;
  if (p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0 || p->block_size <= 0 || p->block_size > 1024 ||
      p->sliding_window < 0)
    return PA_ERR_SHAPE;
  return PA_OK;
}

}  // namespace

extern "C" size_t pa_cuda_workspace_size(const pa_params* p) {
  const int parts = num_partitions(*p);
  if (parts <= 1) return 0;
  return sizeof(float) * size_t(p->num_tokens) * p->num_heads * parts * (p->head_size + 2);
}

extern "C" int pa_cuda_attention(const pa_params* p, const void* q, const void* k_cache, const void* v_cache,
                                 const int32_t* block_tables, const int32_t* context_lens,
                                 const int32_t* query_start_loc, void* out, void* workspace,
                                 size_t workspace_size, void* stream) {
  if (int err = check(p)) return err;
  if (p->head_size != 64 && p->head_size != 128) return PA_ERR_SHAPE;
  if (p->num_tokens == 0) return PA_OK;
  if (workspace_size < pa_cuda_workspace_size(p) || (pa_cuda_workspace_size(p) && !workspace))
    return PA_ERR_WORKSPACE;
  auto* ws = static_cast<float*>(workspace);
  auto s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case PA_FLOAT32:
      return dispatch_head<float>(*p, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, ws, s);
    case PA_BFLOAT16:
      return dispatch_head<__nv_bfloat16>(*p, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                          out, ws, s);
    default:
      return dispatch_head<__half>(*p, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, ws, s);
  }
}

extern "C" int pa_cuda_write_kv(const pa_params* p, const void* k, const void* v, int64_t st, int64_t sh,
                                const int64_t* slot_mapping, void* k_cache, void* v_cache, void* stream) {
  if (int err = check(p)) return err;
  if (p->num_tokens == 0) return PA_OK;
  auto s = static_cast<cudaStream_t>(stream);
  const int threads = p->num_kv_heads * p->head_size < 1024 ? p->num_kv_heads * p->head_size : 1024;
  switch (p->dtype) {
    case PA_FLOAT32:
      write_kv_kernel<float><<<p->num_tokens, threads, 0, s>>>(*p, static_cast<const float*>(k),
          static_cast<const float*>(v), st, sh, slot_mapping, static_cast<float*>(k_cache),
          static_cast<float*>(v_cache));
      break;
    case PA_BFLOAT16:
      write_kv_kernel<__nv_bfloat16><<<p->num_tokens, threads, 0, s>>>(*p, static_cast<const __nv_bfloat16*>(k),
          static_cast<const __nv_bfloat16*>(v), st, sh, slot_mapping, static_cast<__nv_bfloat16*>(k_cache),
          static_cast<__nv_bfloat16*>(v_cache));
      break;
    default:
      write_kv_kernel<__half><<<p->num_tokens, threads, 0, s>>>(*p, static_cast<const __half*>(k),
          static_cast<const __half*>(v), st, sh, slot_mapping, static_cast<__half*>(k_cache),
          static_cast<__half*>(v_cache));
  }
  return cudaGetLastError() == cudaSuccess ? PA_OK : PA_ERR_LAUNCH;
}
