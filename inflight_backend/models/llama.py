"""A Llama-family decoder over packed tokens (ORCA's selective batching, no padding).

Every token-wise op (embeddings, norms, projections, MLP) runs on all T packed tokens of a step together;
only attention is per sequence, through the paged KV cache. Module names follow Hugging Face's
`LlamaForCausalLM` so checkpoints load by name.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .llama_config import LlamaConfig

if TYPE_CHECKING:
    from .greedy_screen import HeadScreen


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); given the residual stream, first adds x to it (the residual add fused into the norm that
        follows it, as vLLM does) and returns (norm(residual + x), residual + x)."""
        if residual is not None:
            x = residual = residual + x
        # As transformers: normalise in fp32, round to the input dtype, then scale (one fused kernel for the first).
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return h if residual is None else (h, residual)


class Rotary(nn.Module):
    """Rotary position embeddings (rotate-half form), optionally with Llama 3 frequency scaling."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if config.rope_scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every token's angles, (T, 1, D): computed once per step and shared by all layers."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rotary(q, k, cos, sin):
    """(T, heads, D) q and (T, kv_heads, D) k rotated; cos, sin: (T, 1, D). When k's heads follow q's in each row
    (a merged qkv projection's output), both go through one set of elementwise ops (half the kernel launches of
    a step on a GPU) and come back as views of one tensor; the values are the same either way."""
    if (qk := qk_rows(q, k)) is not None:
        out = qk * cos + _rotate_half(qk) * sin
        return out[:, :q.shape[1]], out[:, q.shape[1]:]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_rows(q, k):
    """q's and k's heads as one (T, heads + kv_heads, D) view when k's heads follow q's in each row of one tensor
    (a merged qkv projection's output); else None."""
    if not _heads_follow(q, k):
        return None
    tokens, heads, dim = q.shape
    row = q.stride(0) if tokens > 1 else (heads + k.shape[1]) * dim  # a single token's stride is arbitrary
    return q.as_strided((tokens, heads + k.shape[1], dim), (row, dim, 1))


def _heads_follow(q, k) -> bool:
    """k's heads right after q's in each row of one tensor (two tensors that merely sit side by side in memory,
    as a caching allocator may place them, do not count: a view of one cannot reach into the other)."""
    dim = q.shape[2]
    return (q.stride()[1:] == k.stride()[1:] == (dim, 1) and k.shape[2] == dim and q.dtype == k.dtype
            and (q.shape[0] == 1 or q.stride(0) == k.stride(0))
            and k.data_ptr() == q.data_ptr() + q.shape[1] * dim * q.element_size()
            and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr())


def silu_mul(gate, up):
    return F.silu(gate) * up


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    rotary = staticmethod(apply_rotary)  # (q, k, cos, sin) -> (q, k); models/cpu_ops.py may fuse it

    def __init__(self, config: LlamaConfig, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        self.window = window  # sliding window in tokens; 0: full causal attention
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def merge_projections(self) -> None:
        """Replace q/k/v_proj by one linear layer with their weights stacked: one GEMM per step instead of three,
        whose output rows hold each token's q, k and v heads side by side."""
        self.qkv_proj = merged_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata, rows: torch.Tensor | None = None):
        """rope: the step's (cos, sin) tables from Rotary.tables; `rows`: project only these tokens' outputs
        (every token's K and V are still written)."""
        num_tokens, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # views below: rows of heads * d + 2 * kv_heads * d values
            q = qkv[:, :heads * d].view(num_tokens, heads, d)
            k = qkv[:, heads * d:(heads + kv_heads) * d].view(num_tokens, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d:].view(num_tokens, kv_heads, d)
        else:
            q = self.q_proj(x).view(num_tokens, heads, d)  # (T, H, D)
            k = self.k_proj(x).view(num_tokens, kv_heads, d)  # (T, Hkv, D)
            v = self.v_proj(x).view(num_tokens, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:  # per head: rows of d values (reshape copies)
            q = self.q_norm(q.reshape(-1, d)).view(num_tokens, heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(num_tokens, kv_heads, d)
        q, k = self.rotary(q, k, *rope)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k_cache, v_cache, k, v, meta)
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale, self.window).reshape(num_tokens, -1)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    act_mul = staticmethod(silu_mul)  # (gate, up) -> silu(gate) * up; models/cpu_ops.py may fuse it

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by merge_projections

    def merge_projections(self) -> None:
        """Replace gate_proj and up_proj by one linear layer whose output rows are [gate | up]."""
        self.gate_up_proj = merged_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            half = gate_up.shape[-1] // 2
            return self.down_proj(self.act_mul(gate_up[..., :half], gate_up[..., half:]))
        return self.down_proj(self.act_mul(self.gate_proj(x), self.up_proj(x)))


def merge_projections(model: nn.Module) -> None:
    """In every module that offers it: q/k/v in one linear layer and gate/up in another (four GEMMs a layer
    instead of seven), and so q and k side by side in each row, which apply_rotary rotates as one."""
    for module in model.modules():
        if callable(merge := getattr(module, "merge_projections", None)):
            merge()


def install_fused_ops(model: nn.Module, rotary, act_mul, fused_norm) -> None:
    """Every Attention's rotary and MLP's act_mul replaced (as their class attributes' signatures), and every
    RMSNorm by fused_norm(norm) (models/cpu_ops.py and cuda_ops.py: a kernel library's fused ops)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.rotary = rotary
        elif isinstance(module, MLP):
            module.act_mul = act_mul
    _replace_norms(model, fused_norm)


def _replace_norms(module: nn.Module, fused_norm) -> None:
    for name, child in module.named_children():
        if type(child) is RMSNorm:
            setattr(module, name, fused_norm(child))
        else:
            _replace_norms(child, fused_norm)


def merged_linear(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear computing the given ones' outputs side by side (their weights stacked by output)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                       device=weight.device, dtype=weight.dtype)
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if merged.bias is not None:
        merged.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return merged


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, residual, rope, kv_cache, meta, rows: torch.Tensor | None = None):
        """One layer on the residual stream, each residual add fused into the norm after it: `h` is the output
        of the layer before, still to be added to `residual` (at the first layer: the embeddings, and residual
        None). Returns (this layer's output, residual), for `rows` of the tokens only when given."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = config.layer_windows or (0,) * config.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(config, backend, windows[i]) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)


class LlamaForCausalLM(nn.Module):
    """forward(packed tokens) -> logits of the tokens at `sample_indices` only."""

    def __init__(self, config: LlamaConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.linear_layout = "torch (nn.Linear)"  # what models/device_kernels.py chose
        self.load_report = ""  # what loading took (checkpoint.py)
        self.decoder_stack: Callable | None = None  # the layers in one native call (models/decoder_stack.py)
        self.greedy_screen: HeadScreen | None = None  # greedy steps' LM head, screened (models/greedy_screen.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, sample_indices: torch.Tensor, screen: bool = False) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches: one (k, v) pair per layer -> (num_sampled, vocab) fp32.
        `screen` (with a greedy screen): the screen's logits, for `greedy_screen.refine` once masked."""
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        rope = self.model.rotary.tables(positions, h.dtype)
        # Past the last layer's attention only the sampled rows matter (in a prompt chunk, its last token): the
        # layer's o projection and MLP run on those alone, a 1/num_layers share of a prefill's work less.
        rows = sample_indices if sample_indices.shape[0] < input_ids.shape[0] else None
        if self.decoder_stack is not None:  # the same layers in one native call
            h, residual = self.decoder_stack(h, rope, kv_caches, meta, rows)
        else:
            residual, last = None, len(self.model.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
                h, residual = layer(h, residual, rope, kv_cache, meta, rows if i == last else None)
            assert residual is not None  # every model has a layer
        if rows is None:
            h, residual = h[sample_indices], residual[sample_indices]
        x, _ = self.model.norm(h, residual)
        if screen and self.greedy_screen is not None:
            return self.greedy_screen.screen(x)
        return self.lm_head(x).float()
