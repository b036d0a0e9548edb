"""Writes a tiny Llama checkpoint with seeded random weights and a byte-level tokenizer (no download).

Every UTF-8 byte is one token (id == byte value), then <s> (BOS) and </s> (EOS). The output is gibberish
but the checkpoint is a real Hugging Face Llama directory: transformers loads it too.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS_ID, EOS_ID = 256, 257
VOCAB_SIZE = 258


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a generated checkpoint (defaults: the project's default tiny model)."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    seed: int = 0
    num_shards: int = 1
    vocab_size: int = VOCAB_SIZE  # ids past the 258 byte-level ones are special `<extra_i>` tokens


def make_model(out_dir: str, spec: TinySpec = TinySpec()) -> str:
    """Create the checkpoint in `out_dir` (overwriting) and return the directory."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_hf_config(spec), f, indent=2)
    _save_weights(out_dir, _random_weights(spec), spec.num_shards)
    byte_level_tokenizer(spec.vocab_size).save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(spec), f, indent=2)
    return out_dir


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _tokenizer_config(spec: TinySpec) -> dict:
    """What clients given --tokenizer-dir (genai-perf, TensorRT-LLM's and vLLM's clients) read through
    transformers' AutoTokenizer: the fast tokenizer of tokenizer.json as written, its BOS/EOS, a chat template."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "</s>", "model_max_length": spec.max_position_embeddings, "chat_template": CHAT_TEMPLATE}


def _hf_config(spec: TinySpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def _random_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Unit-variance embeddings and 1/sqrt(fan_in) projections, so logits are well separated (greedy ties
    would make token-for-token comparisons depend on rounding)."""
    gen = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden_size // spec.num_attention_heads
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (spec.num_attention_heads * head_dim, h), "k_proj": (spec.num_key_value_heads * head_dim, h),
              "v_proj": (spec.num_key_value_heads * head_dim, h), "o_proj": (h, spec.num_attention_heads * head_dim)}
    mlp = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def normal(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h, std=1.0)}
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for name, shape in shapes.items():
            weights[prefix + f"self_attn.{name}.weight"] = normal(*shape, std=shape[1] ** -0.5)
        for name, shape in mlp.items():
            weights[prefix + f"mlp.{name}.weight"] = normal(*shape, std=shape[1] ** -0.5)
        weights[prefix + "input_layernorm.weight"] = 1 + normal(h, std=0.1)
        weights[prefix + "post_attention_layernorm.weight"] = 1 + normal(h, std=0.1)
    weights["model.norm.weight"] = 1 + normal(h, std=0.1)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h, std=1.0)
    return weights


def _save_weights(out_dir: str, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    for old in os.listdir(out_dir):
        if old.endswith(".safetensors") or old == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, old))
    names = list(weights)
    if num_shards == 1:
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n].contiguous() for n in names[shard::num_shards]}
        save_file(part, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"] + [f"<extra_{i}>" for i in range(vocab_size - VOCAB_SIZE)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tokenizer
