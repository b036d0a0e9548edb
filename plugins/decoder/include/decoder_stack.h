// A Llama decoder's layer stack for one engine step on the CPU, in one call: every layer's norms, projections,
// rotary embedding, paged KV write, attention and MLP, through the same kernels the Python modules call one by
// one (plugins/linear, plugins/cpu_ops, plugins/paged_attention), in the same order on the same buffers, so its
// results are bitwise those of the module path. What it removes is the ~100 Python calls a step that sit between
// those kernels (their argument checks, views and output tensors): most of a small decode step beyond its GEMMs.
//
// fp32 (dec_forward_f32: weights packed by sg_pack_f32, and optionally sg_amx_pack_f32) or bf16 (dec_forward_bf16:
// weights packed by sg_bf16_pack; norms, rotary tables, KV caches and activations bf16 bits; biases fp32), q/k/v
// and gate/up merged; KV caches laid out as paged_attention.h describes. The step's embeddings come in `h`; on return `h` holds the last layer's output and `residual` the
// residual stream before it (the model's final norm adds the two, as the module path does).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DEC_OK = 0, DEC_ERR_SHAPE = 1, DEC_ERR_WORKSPACE = 2, DEC_ERR_GEMM = 3, DEC_ERR_OPS = 4,
       DEC_ERR_ATTENTION = 5 };

// Norms, packed weights and caches are of the call's element type (float, or bf16 bits); biases are fp32.
typedef struct dec_layer {
  const void* input_norm;     // (hidden,)
  const void* post_norm;      // (hidden,)
  const void* qkv;            // packed (hidden, q_size + 2 kv_size): each token's q heads, then k, then v
  const float* qkv_bias;      // (q_size + 2 kv_size,) or NULL
  const void* o;              // packed (q_size, hidden)
  const float* o_bias;        // or NULL
  const void* gate_up;        // packed (hidden, 2 intermediate): [gate | up]
  const float* gate_up_bias;  // or NULL
  const void* down;           // packed (intermediate, hidden)
  const float* down_bias;     // or NULL
  // fp32: the same four weights packed by sg_amx_pack_f32 (amx_gemm.h), or NULL: steps of at least
  // SG_AMX_MIN_ROWS tokens then multiply through AMX, as PackedLinear does. bf16: unused.
  const uint16_t* qkv_amx;
  const uint16_t* o_amx;
  const uint16_t* gate_up_amx;
  const uint16_t* down_amx;
  void* k_cache;              // (num_blocks, block_size, num_kv_heads, head_dim) at the strides of dec_stack
  void* v_cache;
  int32_t sliding_window;     // 0: full causal attention
  int32_t reserved;           // 0
} dec_layer;

typedef struct dec_stack {
  int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, reserved;
  float eps;    // every RMSNorm's
  float scale;  // attention's softmax scale
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  const dec_layer* layers;  // num_layers of them
} dec_stack;

// One step's tokens and their paged-attention metadata (as paged_attention.h's arguments).
typedef struct dec_step {
  int32_t num_tokens, num_seqs, max_blocks_per_seq, max_context_len;
  const void* cos;  // (num_tokens, head_dim): the rotary tables, shared by every layer (the call's type)
  const void* sin;
  const int32_t* block_tables;     // (num_seqs, max_blocks_per_seq)
  const int32_t* context_lens;     // (num_seqs,)
  const int32_t* query_start_loc;  // (num_seqs + 1,)
  const int64_t* slot_mapping;     // (num_tokens,)
  // The rows whose outputs the caller reads (any order, repeats allowed), or NULL: all of them. With fewer rows
  // than tokens the last layer runs its o projection and MLP on those rows only (every layer still writes every
  // token's K and V), and h and residual hold them in their first num_rows rows.
  const int64_t* rows;
  int64_t num_rows;
} dec_step;

// Values of workspace (floats for dec_forward_f32, bf16 values for dec_forward_bf16) a step of `num_tokens`
// tokens needs.
int64_t dec_workspace_floats(const dec_stack* s, int64_t num_tokens);

// Run every layer. h: (num_tokens, hidden) contiguous, the embeddings in, the last layer's output out;
// residual: (num_tokens, hidden) contiguous, written. Returns DEC_OK, or the first failing kernel's kind (the
// outputs and KV caches are then partly written). With num_tokens 0 it only checks the shapes.
int dec_forward_f32(const dec_stack* s, const dec_step* step, float* h, float* residual, float* workspace,
                    int64_t workspace_floats);

// The same for a bfloat16 model: h, residual and workspace hold bf16 bits; each kernel is the module path's
// (bf16_gemm.h, cpu_ops.h's _bf16 ops, bf16 paged attention).
int dec_forward_bf16(const dec_stack* s, const dec_step* step, uint16_t* h, uint16_t* residual,
                     uint16_t* workspace, int64_t workspace_values);

#ifdef __cplusplus
}
#endif
