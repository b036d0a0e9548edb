// The decoder layer stack in one call (see include/decoder_stack.h). Each layer, on the residual stream:
//   n = RMSNorm(residual += h)          (layer 0: residual = h, n = RMSNorm(h))
//   qkv = n @ Wqkv; rotary on q and k in place; k, v -> the paged cache; a = attention(q)
//   h = a @ Wo; n = RMSNorm(residual += h); gu = n @ Wgate_up; act = silu(gate) * up; h = act @ Wdown
// the same kernel calls, arguments and order as models/llama.py's modules with models/cpu_ops.py's fused ops,
// in fp32 or (bf16 GEMM, bf16 ops, bf16 caches) for a bfloat16 model.
// In the last layer only the step's sampled rows (dec_step.rows) go on past attention: the rest would only feed
// logits nobody reads (in a prompt chunk, every token but the last).
#include "decoder_stack.h"

#include <string.h>

#include "amx_gemm.h"
#include "bf16_gemm.h"
#include "cpu_ops.h"
#include "paged_attention.h"
#include "skinny_gemm.h"

namespace {

struct Widths {
  int64_t hidden, q, kv, qkv, inter;
  explicit Widths(const dec_stack& s)
      : hidden(s.hidden), q(int64_t(s.num_heads) * s.head_dim), kv(int64_t(s.num_kv_heads) * s.head_dim),
        qkv(q + 2 * kv), inter(s.intermediate) {}
  // Per token: the normed input, then one region the attention half (qkv, its output) and the MLP half
  // (gate/up, its activation) take in turn.
  int64_t attention_half() const { return qkv + q; }
  int64_t mlp_half() const { return 3 * inter; }
  int64_t per_token() const { return hidden + (attention_half() > mlp_half() ? attention_half() : mlp_half()); }
};

bool valid(const dec_stack& s) {
  return s.num_layers > 0 && s.hidden > 0 && s.num_heads > 0 && s.num_kv_heads > 0 && s.head_dim > 0 &&
         s.intermediate > 0 && s.block_size > 0 && s.layers != nullptr;
}

// The step's attention parameters; each layer sets its own sliding window.
pa_params attention_params(const dec_stack& s, const dec_step& st, const Widths& w, int dtype) {
  pa_params p{};
  p.num_seqs = st.num_seqs;
  p.num_tokens = st.num_tokens;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_size = s.head_dim;
  p.block_size = s.block_size;
  p.max_blocks_per_seq = st.max_blocks_per_seq;
  p.max_context_len = st.max_context_len;
  p.scale = s.scale;
  p.dtype = dtype;
  p.q_stride_token = w.qkv;  // q is read in place from the qkv rows
  p.q_stride_head = s.head_dim;
  p.out_stride_token = w.q;
  p.out_stride_head = s.head_dim;
  p.kv_stride_block = s.kv_stride_block;
  p.kv_stride_token = s.kv_stride_token;
  p.kv_stride_head = s.kv_stride_head;
  return p;
}

// The kernels of one element type: fp32 (the skinny GEMM, or AMX where the layer has that form and T is large
// enough) or bf16 bits (the bf16 GEMM); the fused ops and attention of that type.
struct F32 {
  using T = float;
  static constexpr int kAttention = PA_FLOAT32;
  static int linear(const float* x, int64_t rows, int64_t K, const void* w, const uint16_t* w_amx, int64_t N,
                    const float* bias, float* y) {
    return w_amx && rows >= SG_AMX_MIN_ROWS ? sg_amx_gemm_f32(x, rows, K, K, w_amx, N, bias, y)
                                            : sg_gemm_f32(x, rows, K, K, static_cast<const float*>(w), N, bias, y);
  }
  static int rms_norm(const float* x, int64_t rows, int64_t n, const void* w, float eps, float* y) {
    return ops_rms_norm_f32(x, rows, n, n, static_cast<const float*>(w), eps, y);
  }
  static int add_rms_norm(float* r, const float* h, int64_t rows, int64_t n, const void* w, float eps, float* y) {
    return ops_add_rms_norm_f32(r, h, rows, n, n, n, static_cast<const float*>(w), eps, y);
  }
  static int rotary(float* v, int64_t rows, int64_t heads, int64_t d, int64_t ld, const void* c, const void* s) {
    return ops_rotary_f32(v, rows, heads, d, ld, static_cast<const float*>(c), static_cast<const float*>(s));
  }
  static int silu_mul(const float* g, const float* u, int64_t rows, int64_t n, int64_t ld, float* out) {
    return ops_silu_mul_f32(g, u, rows, n, ld, out);
  }
};

struct BF16 {
  using T = uint16_t;
  static constexpr int kAttention = PA_BFLOAT16;
  static int linear(const uint16_t* x, int64_t rows, int64_t K, const void* w, const uint16_t*, int64_t N,
                    const float* bias, uint16_t* y) {
    return sg_bf16_gemm(x, rows, K, K, static_cast<const uint16_t*>(w), N, bias, y);
  }
  static int rms_norm(const uint16_t* x, int64_t rows, int64_t n, const void* w, float eps, uint16_t* y) {
    return ops_rms_norm_bf16(x, rows, n, n, static_cast<const uint16_t*>(w), eps, y);
  }
  static int add_rms_norm(uint16_t* r, const uint16_t* h, int64_t rows, int64_t n, const void* w, float eps,
                          uint16_t* y) {
    return ops_add_rms_norm_bf16(r, h, rows, n, n, n, static_cast<const uint16_t*>(w), eps, y);
  }
  static int rotary(uint16_t* v, int64_t rows, int64_t heads, int64_t d, int64_t ld, const void* c,
                    const void* s) {
    return ops_rotary_bf16(v, rows, heads, d, ld, static_cast<const uint16_t*>(c), static_cast<const uint16_t*>(s));
  }
  static int silu_mul(const uint16_t* g, const uint16_t* u, int64_t rows, int64_t n, int64_t ld, uint16_t* out) {
    return ops_silu_mul_bf16(g, u, rows, n, ld, out);
  }
};

// The last layer's rows: attention outputs `rows` of attn (T, q) into the front of `spent` (the step's qkv rows,
// read by attention and no longer needed), and the same rows of residual (T, hidden) into its own front, through
// `scratch` (at least rows x hidden values) because rows may come in any order. Returns their count, or -1 when a
// row is out of range.
template <typename T>
int64_t gather_rows(const int64_t* rows, int64_t n, int64_t count, const T* attn, int64_t q, T* spent, T* residual,
                    int64_t hidden, T* scratch) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= count) return -1;
    memcpy(spent + i * q, attn + rows[i] * q, sizeof(T) * q);
    memcpy(scratch + i * hidden, residual + rows[i] * hidden, sizeof(T) * hidden);
  }
  memcpy(residual, scratch, sizeof(T) * n * hidden);
  return n;
}

template <typename K>
int forward(const dec_stack* s, const dec_step* st, typename K::T* h, typename K::T* residual,
            typename K::T* workspace, int64_t workspace_size) {
  using T = typename K::T;
  if (!valid(*s) || st->num_tokens < 0 || st->num_seqs < 0 || st->num_rows < 0) return DEC_ERR_SHAPE;
  const Widths w(*s);
  const int64_t count = st->num_tokens;
  if (workspace_size < w.per_token() * count || (count > 0 && workspace == nullptr)) return DEC_ERR_WORKSPACE;
  T* normed = workspace;                     // (count, hidden)
  T* qkv = workspace + count * w.hidden;     // (count, qkv)
  T* attn = qkv + count * w.qkv;             // (count, q)
  T* gate_up = qkv;                          // (count, 2 inter), once qkv and attn are spent
  T* act = gate_up + count * 2 * w.inter;    // (count, inter)
  pa_params p = attention_params(*s, *st, w, K::kAttention);
  for (int32_t l = 0; l < s->num_layers; ++l) {
    const dec_layer& L = s->layers[l];
    if (l == 0) {
      memcpy(residual, h, sizeof(T) * count * w.hidden);
      if (K::rms_norm(residual, count, w.hidden, L.input_norm, s->eps, normed)) return DEC_ERR_OPS;
    } else if (K::add_rms_norm(residual, h, count, w.hidden, L.input_norm, s->eps, normed)) {
      return DEC_ERR_OPS;
    }
    if (K::linear(normed, count, w.hidden, L.qkv, L.qkv_amx, w.qkv, L.qkv_bias, qkv)) return DEC_ERR_GEMM;
    // q's and k's heads lie side by side in each row: one rotary call over both.
    if (K::rotary(qkv, count, s->num_heads + s->num_kv_heads, s->head_dim, w.qkv, st->cos, st->sin))
      return DEC_ERR_OPS;
    p.sliding_window = L.sliding_window;
    if (pa_cpu_write_kv(&p, qkv + w.q, qkv + w.q + w.kv, w.qkv, s->head_dim, st->slot_mapping, L.k_cache,
                        L.v_cache))
      return DEC_ERR_ATTENTION;
    if (pa_cpu_attention(&p, qkv, L.k_cache, L.v_cache, st->block_tables, st->context_lens, st->query_start_loc,
                         attn))
      return DEC_ERR_ATTENTION;
    int64_t rows = count;  // rows from here on
    const T* a = attn;
    if (l == s->num_layers - 1 && st->rows != nullptr && st->num_rows < count) {
      rows = gather_rows(st->rows, st->num_rows, count, attn, w.q, qkv, residual, w.hidden, normed);
      if (rows < 0) return DEC_ERR_SHAPE;
      a = qkv;
    }
    if (K::linear(a, rows, w.q, L.o, L.o_amx, w.hidden, L.o_bias, h)) return DEC_ERR_GEMM;
    if (K::add_rms_norm(residual, h, rows, w.hidden, L.post_norm, s->eps, normed)) return DEC_ERR_OPS;
    if (K::linear(normed, rows, w.hidden, L.gate_up, L.gate_up_amx, 2 * w.inter, L.gate_up_bias, gate_up))
      return DEC_ERR_GEMM;
    if (K::silu_mul(gate_up, gate_up + w.inter, rows, w.inter, 2 * w.inter, act)) return DEC_ERR_OPS;
    if (K::linear(act, rows, w.inter, L.down, L.down_amx, w.hidden, L.down_bias, h)) return DEC_ERR_GEMM;
  }
  return DEC_OK;
}

}  // namespace

extern "C" int64_t dec_workspace_floats(const dec_stack* s, int64_t num_tokens) {
  return Widths(*s).per_token() * (num_tokens > 0 ? num_tokens : 0);
}

extern "C" int dec_forward_f32(const dec_stack* s, const dec_step* st, float* h, float* residual, float* workspace,
                               int64_t workspace_floats) {
  return forward<F32>(s, st, h, residual, workspace, workspace_floats);
}

extern "C" int dec_forward_bf16(const dec_stack* s, const dec_step* st, uint16_t* h, uint16_t* residual,
                                uint16_t* workspace, int64_t workspace_values) {
  return forward<BF16>(s, st, h, residual, workspace, workspace_values);
}
