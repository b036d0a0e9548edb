"""A Llama-family checkpoint's shape and settings (`LlamaConfig`), read from Hugging Face's config.json: Llama,
Mistral, Qwen2 and Qwen3 (biases, per-head q/k norms, sliding windows), rope scaling. Plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Llama's attention_bias (with o_proj_bias), or Qwen2's q/k/v biases alone
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before the rotary embedding
    layer_windows: tuple[int, ...] = ()  # sliding-window attention: each layer's window (0: full), () for none
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """From a Hugging Face config.json dict (rope settings at top level or under `rope_parameters`)."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (Llama uses silu)")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        family = cfg.get("model_type", "llama")
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias or family == "qwen2",
            o_proj_bias=attention_bias,
            qk_norm=family == "qwen3",
            mlp_bias=cfg.get("mlp_bias", False),
            layer_windows=_layer_windows(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def _layer_windows(cfg: dict) -> tuple[int, ...]:
    """Each layer's sliding window as transformers builds it: Mistral's `sliding_window` on every layer; Qwen2 and
    Qwen3 only with `use_sliding_window`, on the layers `layer_types` names (default: from `max_window_layers`
    on). () when no layer has one."""
    window = cfg.get("sliding_window") or 0
    if not window or not cfg.get("use_sliding_window", True):
        return ()
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()
