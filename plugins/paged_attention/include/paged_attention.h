/* Paged attention: one C ABI for the CPU and CUDA kernels.
 *
 * Layout (strides in elements; the last dimension of every tensor is contiguous):
 *   q, out           (num_tokens, num_heads, head_size)       packed query tokens of all sequences
 *   k_cache, v_cache (num_blocks, block_size, num_kv_heads, head_size)
 *   block_tables     (num_seqs, max_blocks_per_seq) int32     physical block of each logical block
 *   context_lens     (num_seqs,) int32                        cached + new tokens of each sequence
 *   query_start_loc  (num_seqs + 1,) int32                    sequence i owns query rows [qsl[i], qsl[i+1])
 *   slot_mapping     (num_tokens,) int64                      flat slot (block * block_size + offset); < 0 skips
 *
 * The queries of sequence i are its last (qsl[i+1] - qsl[i]) context tokens; attention is causal among them.
 * With sliding_window W > 0 the query at position t sees keys t - W + 1 .. t only (Mistral's window, as
 * transformers masks it: key k is seen when t - W < k <= t); blocks wholly before the window are not read.
 * Query heads h attend to KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 * Every function returns PA_OK or an error code; nothing is written on error.
 */
#ifndef INFLIGHT_PAGED_ATTENTION_H
#define INFLIGHT_PAGED_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum pa_dtype { PA_FLOAT32 = 0, PA_BFLOAT16 = 1, PA_FLOAT16 = 2 };

enum pa_status {
  PA_OK = 0,
  PA_ERR_DTYPE = 1,      /* dtype not supported by this implementation */
  PA_ERR_SHAPE = 2,      /* head_size / heads / block_size outside what this implementation supports */
  PA_ERR_WORKSPACE = 3,  /* workspace missing or too small */
  PA_ERR_LAUNCH = 4      /* the CUDA launch failed */
};

typedef struct pa_params {
  int32_t num_seqs;
  int32_t num_tokens;          /* packed query tokens: query_start_loc[num_seqs] */
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int32_t max_blocks_per_seq;  /* row stride of block_tables */
  int32_t max_context_len;     /* >= every context_lens[i]; sizes the CUDA split-K partitions */
  float scale;                 /* softmax scale, usually 1/sqrt(head_size) */
  int32_t dtype;               /* enum pa_dtype of q, out, k_cache and v_cache */
  int32_t sliding_window;      /* 0: every earlier key; W > 0: the last W keys, the query's own included */
  int32_t reserved;            /* 0; keeps the 64-bit strides aligned the same way for every compiler */
  int64_t q_stride_token, q_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
} pa_params;

/* CPU (OpenMP over sequences x KV heads, online softmax in fp32). fp32 and bf16. */
int pa_cpu_attention(const pa_params* p, const void* q, const void* k_cache, const void* v_cache,
                     const int32_t* block_tables, const int32_t* context_lens, const int32_t* query_start_loc,
                     void* out);
/* k, v: (num_tokens, num_kv_heads, head_size) with strides k_stride_token/head (same for v). */
int pa_cpu_write_kv(const pa_params* p, const void* k, const void* v, int64_t kv_src_stride_token,
                    int64_t kv_src_stride_head, const int64_t* slot_mapping, void* k_cache, void* v_cache);

/* CUDA. `stream` is a cudaStream_t. Attention needs pa_cuda_workspace_size() bytes of device workspace. */
size_t pa_cuda_workspace_size(const pa_params* p);
int pa_cuda_attention(const pa_params* p, const void* q, const void* k_cache, const void* v_cache,
                      const int32_t* block_tables, const int32_t* context_lens, const int32_t* query_start_loc,
                      void* out, void* workspace, size_t workspace_size, void* stream);
int pa_cuda_write_kv(const pa_params* p, const void* k, const void* v, int64_t kv_src_stride_token,
                     int64_t kv_src_stride_head, const int64_t* slot_mapping, void* k_cache, void* v_cache,
                     void* stream);

#ifdef __cplusplus
}
#endif

#endif
