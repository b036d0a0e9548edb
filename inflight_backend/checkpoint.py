"""Loads a Hugging Face Llama checkpoint directory: config.json (with generation_config.json's end ids where
present), *.safetensors (sharded too), tokenizer.json."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from glob import glob

import torch
from torch import nn
from safetensors import safe_open
from tokenizers import Tokenizer

from .attention import AttentionBackend
from .models.llama import LlamaForCausalLM
from .models.llama_config import LlamaConfig


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
    config = LlamaConfig.from_hf(raw)
    if config.layer_windows and len(config.layer_windows) != config.num_hidden_layers:
        raise CheckpointError(f"{path}: layer_types names {len(config.layer_windows)} layers, the model has "
                              f"{config.num_hidden_layers}")
    generation = _generation_config(path)
    if generation.get("eos_token_id") is not None:  # what transformers' generate stops at (Llama 3 lists three)
        eos = generation["eos_token_id"]
        config = dataclasses.replace(config, eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
    outside = [t for t in config.eos_token_ids if not 0 <= t < config.vocab_size]
    if outside:
        raise CheckpointError(f"{path}: end token id {outside[0]} is outside the vocabulary (vocab_size "
                              f"{config.vocab_size})")
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


def load_model(path: str, backend: AttentionBackend, dtype: torch.dtype) -> LlamaForCausalLM:
    """Build the model and load every safetensors shard in `path` into it (strictly: no missing/extra weights),
    on the CPU with torch's modules; models/device_kernels.py then picks its kernels and device.
    `model.load_report` says what it took."""
    config = load_config(path)
    shards = sorted(glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise CheckpointError(f"no *.safetensors weights in checkpoint directory {path!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    start, rss_before = time.perf_counter(), _rss_bytes()
    num_bytes = _load_weights(model, shards, dtype, config.tie_word_embeddings, path)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = type(model.model.rotary)(config)  # rebuild the non-persistent buffer off meta
    grown = (_rss_bytes() - rss_before) / 2**20
    model.load_report = (f"weights {num_bytes / 2**20:.0f} MiB as {str(dtype).removeprefix('torch.')} loaded in "
                         f"{time.perf_counter() - start:.1f} s, process memory +{grown:.0f} MiB")
    return model


def _load_weights(model: nn.Module, shards: list[str], dtype: torch.dtype, tied: bool, path: str) -> int:
    """Each tensor read from its memory-mapped shard, cast and put in place one at a time, so the checkpoint is
    never in memory twice (a whole-file load plus its cast would be two copies). Strict: no missing or extra
    weights. Returns the bytes loaded."""
    expected = {name for name, _ in model.named_parameters()}
    if tied:
        expected.discard("lm_head.weight")
    seen, unexpected, num_bytes = set(), [], 0
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name).to(dtype)
                module_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
                seen.add(name)
                num_bytes += tensor.numel() * tensor.element_size()
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    return num_bytes


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
