// bf16 GEMM (see include/bf16_gemm.h): the greedy screen's panels and walk (bf16_panels.h), bf16 in and out.
#include "bf16_gemm.h"

#include <vector>

#include "bf16_panels.h"
#include "skinny_gemm.h"

using inflight::bf16::pairs;

extern "C" int sg_bf16_available(void) {
#ifdef GS_BUILD
  static const int ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return 0;
#endif
}

extern "C" int64_t sg_bf16_packed_size(int64_t K, int64_t N) { return inflight::bf16::packed_size(K, N); }

extern "C" int sg_bf16_pack(const uint16_t* w, int64_t K, int64_t N, int64_t stride_k, int64_t stride_n,
                            uint16_t* packed) {
  if (K <= 0 || N <= 0) return SG_ERR_SHAPE;
  inflight::bf16::pack_panels(K, N, packed, [=](int64_t k, int64_t n) { return w[k * stride_k + n * stride_n]; });
  return SG_OK;
}

extern "C" int sg_bf16_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* packed, int64_t N,
                            const float* bias, uint16_t* y) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K) return SG_ERR_SHAPE;
  if (!sg_bf16_available()) return SG_ERR_UNSUPPORTED;
  if (M == 0) return SG_OK;
#ifdef GS_BUILD
  const int64_t P = pairs(K);
  // x's rows are read as (x[2p], x[2p+1]) pairs in place where they are whole and 4-byte aligned; else copied,
  // an odd K's last pair completed with a zero.
  std::vector<uint32_t> copy;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  int64_t ldp = ldx / 2;
  if (K % 2 || ldx % 2 || reinterpret_cast<uintptr_t>(x) % 4) {
    copy.resize(M * P);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t p = 0; p < P; ++p)
        copy[i * P + p] = x[i * ldx + 2 * p] | (2 * p + 1 < K ? (uint32_t)x[i * ldx + 2 * p + 1] << 16 : 0u);
    xp = copy.data(), ldp = P;
  }
  inflight::bf16::walk(xp, ldp, M, P, packed, N, bias, y, sg_stream_ahead(-1));
  return SG_OK;
#else
  (void)x, (void)packed, (void)bias, (void)y;
  return SG_ERR_UNSUPPORTED;
#endif
}
