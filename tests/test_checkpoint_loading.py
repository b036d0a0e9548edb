"""Loading a checkpoint holds it in memory once: each tensor is read from its memory-mapped shard and cast on its
own. Measured in a fresh process by sampling its anonymous memory (page-cache pages of the mapped file are not a
copy) while a bfloat16 checkpoint loads as float32."""
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.load_checkpoint import probe
from inflight_backend.make_model import TinySpec, make_model


def test_a_bfloat16_checkpoint_loads_as_float32_without_a_second_copy(tmp_path):
    path = make_model(str(tmp_path / "ckpt"), TinySpec(hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                                                       num_attention_heads=12, num_key_value_heads=12))
    shard = f"{path}/model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(shard).items()}, shard)
    result = probe(Path(path), "float32", "torch")  # a fresh process sampling its own anonymous memory
    peak, weights = result["peak"], result["weights"]
    assert weights > 150 * 2**20
    # Measured at this size: 1.5x (one fp32 copy, plus the largest matrix's input-major copy and the process's
    # own allocations); a whole-file load and its cast held the bf16 and fp32 copies at once: 2.4x.
    assert peak < 1.8 * weights, f"peak {peak / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
    assert "as float32 loaded in" in result["report"]


def test_an_end_token_outside_the_vocabulary_is_refused_at_load(tmp_path):
    import json

    import pytest

    from inflight_backend.checkpoint import CheckpointError, load_config

    path = make_model(str(tmp_path / "ckpt"), TinySpec())
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 128001]}))
    with pytest.raises(CheckpointError, match="end token id 128001 is outside the vocabulary"):
        load_config(path)
