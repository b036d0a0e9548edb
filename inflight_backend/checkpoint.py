"""Loads a Hugging Face Llama checkpoint directory: config.json (with generation_config.json's end ids where
present), *.safetensors (sharded too), tokenizer.json."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from glob import glob

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from .attention import AttentionBackend
from .models import cpu_ops
from .models.cpu_layout import PackedLinear, convert_cpu_linears
from .models.llama import LlamaConfig, LlamaForCausalLM


class CheckpointError(ValueError):
    pass


# One decoder with named switches (models/llama.py): Qwen2's q/k/v biases, Qwen3's q/k norms.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def load_config(path: str) -> LlamaConfig:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"no config.json in checkpoint directory {path!r}")
    with open(config_file) as f:
        raw = json.load(f)
    model_type = raw.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not a decoder this backend runs "
                              f"({', '.join(FAMILIES)})")
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None  # Qwen's switch
    if window and window < raw.get("max_position_embeddings", 0):
        raise CheckpointError(f"{path}: sliding-window attention ({window} tokens) is not supported")
    config = LlamaConfig.from_hf(raw)
    generation = _generation_config(path)
    if generation.get("eos_token_id") is not None:  # what transformers' generate stops at (Llama 3 lists three)
        eos = generation["eos_token_id"]
        config = dataclasses.replace(config, eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
    return config


def _generation_config(path: str) -> dict:
    return _json(os.path.join(path, "generation_config.json"))


def _json(file: str) -> dict:
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer transformers serves for this checkpoint. tokenizer.json as written, unless
    tokenizer_config.json names a tokenizer class that rebuilds its own pipeline (transformers 5's LlamaTokenizer
    does: " Hello" is [<s>, ▁Hello] there and [<s>, ▁, ▁Hello] by tokenizer.json): then that class's pipeline,
    from transformers itself."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise CheckpointError(f"no tokenizer.json in checkpoint directory {path!r}")
    config = _json(os.path.join(path, "tokenizer_config.json"))
    if config.get("tokenizer_class") not in (None, *AS_WRITTEN):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path).backend_tokenizer
        except Exception as exc:  # a class transformers cannot build here: say so, and use the file as written
            print(f"inflight: {path}: tokenizer class {config['tokenizer_class']!r} did not load in transformers "
                  f"({type(exc).__name__}: {exc}); using tokenizer.json as written", file=sys.stderr)
    return Tokenizer.from_file(tokenizer_file)


AS_WRITTEN = ("PreTrainedTokenizerFast", "TokenizersBackend")  # classes that use tokenizer.json unchanged


def load_model(path: str, backend: AttentionBackend, dtype: torch.dtype, device: str,
               linear_backend: str = "auto") -> LlamaForCausalLM:
    """Build the model and load every safetensors shard in `path` into it (strictly: no missing/extra weights).
    On the CPU the linear layers take the layout `linear_backend` selects (models/cpu_layout.py); with the
    native one, the ops between them are fused too (models/cpu_ops.py). The choice is in `model.linear_layout`."""
    config = load_config(path)
    shards = sorted(glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise CheckpointError(f"no *.safetensors weights in checkpoint directory {path!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    state = {}
    for shard in shards:
        state.update(load_file(shard))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = type(model.model.rotary)(config)  # rebuild the non-persistent buffer off meta
    model.linear_layout = "torch (nn.Linear)"
    if torch.device(device).type == "cpu":
        model.linear_layout = convert_cpu_linears(model, linear_backend, dtype)
        ops = cpu_ops.load_library()
        if isinstance(model.lm_head, PackedLinear) and ops is not None:  # fp32, contiguous linear outputs
            cpu_ops.convert_cpu_ops(model, ops)
            model.linear_layout += " + fused CPU ops"
    return model.to(device).eval()
