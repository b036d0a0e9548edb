"""Loading a real-size checkpoint: time and memory of `checkpoint.load_model` on a Llama-3.2-1B-shaped model.

    .venv/bin/python benchmarks/load_checkpoint.py [--checkpoint build/models/llama-1b-shape]
        [--dtypes float32 bfloat16] [--linear-backends auto torch native] [--greedy-screen auto|on|off]

Writes the checkpoint first if it is missing: Llama 3.2 1B's shapes (16 layers, 2048 wide, 32 heads / 8 KV heads,
MLP 8192, vocabulary 128,256, tied embeddings, Llama 3 rope scaling; 1.24B parameters) with random bfloat16
weights in 4 shards, as Meta ships it (bfloat16). Then each (dtype, linear backend) loads it in a fresh process,
which samples its own anonymous memory every millisecond (the memory-mapped shards' page cache is not a copy):
the figure that matters is the peak over the bytes of the parameters the model holds at the end (with the LM head's
greedy screen, its copies too: an fp32 head's bf16 copy; a bf16 head's int8 copy, and an untied one's rows; 1.0:
the weights alone; holding the checkpoint twice, as a whole-file load and its
cast would, is 2.0 and more). On the CPU the tied lm_head gets its own input-major copy, so the parameters are the
checkpoint's weights plus one embedding-sized matrix. A bfloat16 load keeps the embedding table as read from the
mapped shard (file pages, not anonymous memory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

# Runs in a fresh process: argv = checkpoint, dtype, linear backend, greedy screen. Prints peak anonymous bytes over
# the baseline, the bytes the model holds (parameters, and a greedy screen's copy of the head), and its load report.
PROBE = r"""
import sys, threading, time, torch
from inflight_backend.attention import make_backend
from inflight_backend.checkpoint import load_model
from inflight_backend.models.device_kernels import place

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

base = anon()
thread = threading.Thread(target=sample)
thread.start()
model = place(load_model(sys.argv[1], make_backend("torch", torch.device("cpu")), getattr(torch, sys.argv[2])), "cpu",
              sys.argv[3], greedy_screen=sys.argv[4])
stop.set()
thread.join()
params = list(model.parameters())
own = {p.untyped_storage().data_ptr() for p in params}
screen = model.greedy_screen  # its copies of the LM head are held too (not the model's own tensors it points at)
extra = [] if screen is None else [t for t in screen.tensors() if t.untyped_storage().data_ptr() not in own]
print(peak[0] - base, sum(t.numel() * t.element_size() for t in params + extra))
print(model.load_report)
print(model.linear_layout)
"""


def write_checkpoint(path: Path, config: dict, num_shards: int = 4, seed: int = 0, device: str = "cpu") -> None:
    """Random bf16 weights of `config`'s Llama shapes, one shard at a time (never the whole model in memory),
    drawn on `device` (an 8B model's 8 billion draws take minutes on a few CPU cores, a second on a GPU)."""
    from safetensors.torch import save_file

    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layers = config["num_hidden_layers"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()

    path.mkdir(parents=True, exist_ok=True)
    per_shard = -(-layers // num_shards)
    for s in range(num_shards):
        tensors = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = rand(config["vocab_size"], h)
        for n in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            p = f"model.layers.{n}."
            for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                                ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                                ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):
                tensors[p + name + ".weight"] = rand(*shape)
            tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if s == num_shards - 1:
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            if not config.get("tie_word_embeddings"):
                tensors["lm_head.weight"] = rand(config["vocab_size"], h)
        save_file(tensors, str(path / f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"))
        del tensors
    (path / "config.json").write_text(json.dumps(config, indent=2))


def probe(path: Path, dtype: str, linear: str, screen: str = "auto") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), dtype, linear, screen], capture_output=True,
                         text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()
    peak, weights = map(int, out[0].split())
    return {"dtype": dtype, "linear": linear, "peak": peak, "weights": weights, "report": out[1], "layout": out[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "build/models/llama-1b-shape"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--linear-backends", nargs="+", default=["auto"])
    parser.add_argument("--greedy-screen", default="auto", choices=["auto", "on", "off"],
                        help="the LM head's greedy screen (greedy_screen); its copies count as held")
    args = parser.parse_args()
    path = Path(args.checkpoint)
    if not (path / "config.json").exists():
        print(f"writing {path} (Llama-3.2-1B shapes, random bf16 weights)", flush=True)
        write_checkpoint(path, LLAMA_32_1B)
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint {path}: {on_disk / 2**30:.2f} GiB of bf16 safetensors")
    print("| dtype | linear layout | parameters held (MiB) | peak anonymous memory (MiB) | peak / parameters | "
          "load report |")
    print("|---|---|---:|---:|---:|---|")
    for dtype in args.dtypes:
        for linear in args.linear_backends:
            r = probe(path, dtype, linear, args.greedy_screen)
            print(f"| {dtype} | {r['layout']} | {r['weights'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
                  f"{r['peak'] / r['weights']:.2f} | {r['report']} |", flush=True)


if __name__ == "__main__":
    main()
