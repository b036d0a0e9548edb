// Fused CUDA ops (see include/cuda_ops.h): loads and stores in the tensor's dtype, arithmetic in fp32, each
// product and sum rounded to the dtype where torch's separate kernels round it.
#include "cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <typename T> __device__ __forceinline__ float rounded(float x) { return to_f(from_f<T>(x)); }

// One product or sum as a torch kernel of its own computes it: rounded to T by itself (__fmul_rn and __fadd_rn
// also keep nvcc from contracting a product and a sum into one FMA, which would round once).
template <typename T> __device__ __forceinline__ float mul(float a, float b) { return rounded<T>(__fmul_rn(a, b)); }
template <typename T> __device__ __forceinline__ float add(float a, float b) { return rounded<T>(__fadd_rn(a, b)); }

constexpr int kNormThreads = 256;  // a block per row
constexpr int kThreads = 256;      // elementwise kernels: grid-stride loops over every element
constexpr int64_t kMaxBlocks = 1 << 16;

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(T* residual, const T* h, int64_t n, int64_t ldr, int64_t ldh, const T* weight, float eps,
                        T* y) {
  __shared__ float partial[kNormThreads / 32];
  __shared__ float inv_shared;
  T* res = residual + blockIdx.x * ldr;
  const T* hr = h ? h + blockIdx.x * ldh : nullptr;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += kNormThreads) {
    float v = to_f(res[j]);
    if (hr) {
      v = add<T>(v, to_f(hr[j]));
      res[j] = from_f<T>(v);  // read back below by this thread only
    }
    sum += v * v;
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < kNormThreads / 32 ? partial[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (threadIdx.x == 0) inv_shared = rsqrtf(s / float(n) + eps);
  }
  __syncthreads();
  const float inv = inv_shared;
  T* out = y + blockIdx.x * n;
  for (int64_t j = threadIdx.x; j < n; j += kNormThreads)  // fp32 norm rounded to T, then times the weight
    out[j] = from_f<T>(__fmul_rn(to_f(weight[j]), rounded<T>(__fmul_rn(to_f(res[j]), inv))));
}

template <typename T>
__global__ void rotary_kernel(T* v, int64_t tokens, int64_t heads, int64_t half, int64_t ldv, const T* cos,
                              const T* sin) {
  const int64_t total = tokens * heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, head = th % heads, t = th / heads;
    T* x = v + t * ldv + head * 2 * half;
    const T *c = cos + t * 2 * half, *s = sin + t * 2 * half;
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product and the sum rounded
    const float o1 = add<T>(mul<T>(x1, to_f(c[i])), mul<T>(-x2, to_f(s[i])));
    const float o2 = add<T>(mul<T>(x2, to_f(c[i + half])), mul<T>(x1, to_f(s[i + half])));
    x[i] = from_f<T>(o1);
    x[i + half] = from_f<T>(o2);
  }
}

template <typename T>
__global__ void silu_mul_kernel(const T* gate, const T* up, int64_t rows, int64_t n, int64_t ld, T* out) {
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = (idx / n) * ld + idx % n;
    const float g = to_f(gate[at]);
    const float silu = rounded<T>(g / (1.0f + expf(-g)));  // torch's silu: x / (1 + exp(-x)) in fp32
    out[idx] = from_f<T>(__fmul_rn(silu, to_f(up[at])));
  }
}

int64_t blocks_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

int launched() { return cudaGetLastError() == cudaSuccess ? COPS_OK : COPS_ERR_LAUNCH; }

template <typename T>
int add_rms_norm(void* residual, const void* h, int64_t rows, int64_t n, int64_t ldr, int64_t ldh,
                 const void* weight, float eps, void* y, cudaStream_t stream) {
  add_rms_norm_kernel<T><<<(unsigned)rows, kNormThreads, 0, stream>>>(
      static_cast<T*>(residual), static_cast<const T*>(h), n, ldr, ldh, static_cast<const T*>(weight), eps,
      static_cast<T*>(y));
  return launched();
}

template <typename T>
int rotary(void* v, int64_t tokens, int64_t heads, int64_t half, int64_t ldv, const void* cos, const void* sin,
           cudaStream_t stream) {
  rotary_kernel<T><<<(unsigned)blocks_for(tokens * heads * half), kThreads, 0, stream>>>(
      static_cast<T*>(v), tokens, heads, half, ldv, static_cast<const T*>(cos), static_cast<const T*>(sin));
  return launched();
}

template <typename T>
int silu_mul(const void* gate, const void* up, int64_t rows, int64_t n, int64_t ld, void* out, cudaStream_t stream) {
  silu_mul_kernel<T><<<(unsigned)blocks_for(rows * n), kThreads, 0, stream>>>(
      static_cast<const T*>(gate), static_cast<const T*>(up), rows, n, ld, static_cast<T*>(out));
  return launched();
}

}  // namespace

// One instance a dtype; `call` is a generic lambda taking a value of the element type.
#define COPS_DISPATCH(dtype, call)                      \
  switch (dtype) {                                      \
    case COPS_FLOAT32: return call(float{});            \
    case COPS_BFLOAT16: return call(__nv_bfloat16{});   \
    case COPS_FLOAT16: return call(__half{});           \
    default: return COPS_ERR_DTYPE;                     \
  }

extern "C" int cops_add_rms_norm(int dtype, void* residual, const void* h, int64_t rows, int64_t n, int64_t ldr,
                                 int64_t ldh, const void* weight, float eps, void* y, void* stream) {
  if (rows < 0 || n <= 0 || ldr < n || (h && ldh < n) || rows > 0x7fffffff) return COPS_ERR_SHAPE;
  if (rows == 0) return COPS_OK;
  const auto s = static_cast<cudaStream_t>(stream);
  COPS_DISPATCH(dtype, [&](auto t) { return add_rms_norm<decltype(t)>(residual, h, rows, n, ldr, ldh, weight, eps, y, s); })
}

extern "C" int cops_rotary(int dtype, void* v, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldv,
                           const void* cos, const void* sin, void* stream) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 || ldv < heads * head_dim) return COPS_ERR_SHAPE;
  if (tokens == 0) return COPS_OK;
  const auto s = static_cast<cudaStream_t>(stream);
  COPS_DISPATCH(dtype, [&](auto t) { return rotary<decltype(t)>(v, tokens, heads, head_dim / 2, ldv, cos, sin, s); })
}

extern "C" int cops_silu_mul(int dtype, const void* gate, const void* up, int64_t rows, int64_t n, int64_t ld,
                             void* out, void* stream) {
  if (rows < 0 || n <= 0 || ld < n) return COPS_ERR_SHAPE;
  if (rows == 0) return COPS_OK;
  const auto s = static_cast<cudaStream_t>(stream);
  COPS_DISPATCH(dtype, [&](auto t) { return silu_mul<decltype(t)>(gate, up, rows, n, ld, out, s); })
}
