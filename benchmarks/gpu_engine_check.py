"""The engine on a GPU, in process (run by benchmarks/gpu_check.sh after the kernel checks; about 5 minutes on an
H200). Needs torch with CUDA, transformers, tokenizers, safetensors, numpy and jinja2 (the H200 image has them);
no tritonserver.

    python3 benchmarks/gpu_engine_check.py [--device cuda] [--big 8b|small] [--streams 256 1024] [--profile STEPS]
                                            [--skip-big]

1. Oracle: a small random Llama (head size 64, GQA) through InflightEngine on the device, fp32 and bf16, 12
   requests arriving a step apart, greedy, against transformers' `generate` on the same device and dtype.
   fp32 must match token for token; bf16 prints how many requests match (transformers' bf16 matmuls round
   differently from a packed batch's, so a near-tie may flip).
2. The serving ceiling in process: engine `null` at 256 streams (the host CPU's scheduling, sampling and
   detokenizing cost; the GPU does nothing there).
3. Saturated: a Llama-3.1-8B-shaped checkpoint with random bf16 weights, written on the spot to
   build/models/llama-8b-shape, --streams requests of 128 prompt tokens forced to 128 output tokens, all at once:
   output tokens/s. TensorRT-LLM publishes 27,911 output tokens/s for Llama 3.1 8B in FP8 on one H200 at
   128/128; the aim here is at least half (in bf16). Then the largest batch again with every request sampled
   (temperature 0.8, top-p 0.9): the sampler's cost there.
4. CUDA graphs: the oracle and the saturated runs again, graphs captured; then the fused CUDA ops
   (`cuda_fused_ops: on`, plugins/cuda_ops): the oracle and the saturated runs once more, beside the runs before.
`--device cpu --big small` runs the same code on the CPU with small shapes (how the script is checked without a GPU).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.load_checkpoint import LLAMA_32_1B, write_checkpoint  # noqa: E402
from benchmarks.serving_ceiling import in_process  # noqa: E402
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.make_model import TinySpec, byte_level_tokenizer, make_model  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402

LLAMA_31_8B = {**LLAMA_32_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "head_dim": 128, "tie_word_embeddings": False,
               "rope_scaling": {**LLAMA_32_1B["rope_scaling"], "factor": 8.0}}
SMALL_BIG = {**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
             "bos_token_id": 256, "eos_token_id": 257}


def oracle(device: str, dtype: str, path: str, attention: str, graphs: bool = False,
           fused: str = "off") -> tuple[int, int]:
    """(requests whose greedy tokens equal transformers', requests)."""
    from transformers import LlamaForCausalLM

    engine = InflightEngine(EngineConfig(checkpoint=path, device=device, dtype=dtype, num_kv_blocks=512,
                                         max_batch_size=16, attention_backend=attention, cuda_graphs=graphs,
                                         cuda_fused_ops=fused))
    rng = random.Random(0)
    cases = [([256] + [rng.randrange(256) for _ in range(n)], m)
             for n, m in zip([3, 17, 64, 130, 5, 300, 41, 90, 8, 220, 33, 1], [40, 12, 64, 25, 64, 9, 50, 30, 64,
                                                                             16, 44, 64])]
    got = {str(i): [] for i in range(len(cases))}
    step = 0
    while step < len(cases) or engine.has_unfinished():
        if step < len(cases):
            engine.add_request(str(step), cases[step][0], SamplingParams(max_tokens=cases[step][1]))
        for out in engine.step():
            got[out.req_id] += out.token_ids
        step += 1
    hf = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    same = 0
    for i, (ids, n) in enumerate(cases):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                               pad_token_id=0)[0, len(ids):].tolist()
        if 257 in want:
            want = want[:want.index(257) + 1]
        same += got[str(i)] == want
    return same, len(cases)


def saturated(device: str, path: str, streams: int, attention: str, prompt_len: int = 128,
              output_len: int = 128, profile: int = 0, graphs: bool = False, fused: str = "off",
              temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """All `streams` requests at once, run to the end; `profile`: print torch.profiler's tables for that many
    decode steps (from the 20th step on; their time is counted too)."""
    blocks = streams * -(-(prompt_len + output_len) // 16) + 16
    start = time.perf_counter()
    engine = InflightEngine(EngineConfig(checkpoint=path, device=device, dtype="bfloat16", num_kv_blocks=blocks,
                                         max_batch_size=streams, max_num_tokens=8192, enable_chunked_prefill=True,
                                         attention_backend=attention, cuda_graphs=graphs, cuda_fused_ops=fused))
    print(f"engine loaded in {time.perf_counter() - start:.0f} s", flush=True)
    vocab = engine.runner.vocab_size
    rng = random.Random(1)
    for i in range(streams):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=temperature,
                                          top_p=top_p, seed=i))
    if device == "cuda":
        torch.cuda.synchronize()
    start, tokens, profiler = time.perf_counter(), 0, None
    while engine.has_unfinished():
        if profile and engine.stats.num_steps == 20:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        tokens += sum(len(out.token_ids) for out in engine.step())
        if profiler is not None and engine.stats.num_steps == 20 + profile:
            profiler.__exit__(None, None, None)
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(profiler.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
            profiler = None
    wall = time.perf_counter() - start
    s = engine.stats
    return {"streams": streams, "cuda_graphs": graphs, "cuda_fused_ops": fused, "temperature": temperature,
            "top_p": top_p, "output_tokens": tokens,
            "seconds": wall,
            "output_tokens_per_s": tokens / wall,
            "steps": s.num_steps, "model_s": s.model_seconds, "schedule_s": s.schedule_seconds,
            "sample_s": s.sample_seconds}


def oracles(device: str, path: str, attention: str, graphs: bool, fused: str = "off") -> bool:
    """Both dtypes against transformers; True when fp32 matches token for token."""
    ok, mode = True, (", CUDA graphs" if graphs else "") + (f", cuda_fused_ops {fused}" if fused != "off" else "")
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        same, total = oracle(device, dtype, path, attention, graphs, fused)
        print(f"oracle {dtype} on {device}{mode}: {same} of {total} requests equal transformers' greedy tokens "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        ok &= dtype != "float32" or same == total
    return ok


def report(name: str, run: dict) -> dict:
    fused = run["cuda_fused_ops"]
    graphs = (", CUDA graphs" if run["cuda_graphs"] else "") + (f", cuda_fused_ops {fused}" if fused != "off" else "")
    if run["temperature"]:
        graphs += f", sampled (temperature {run['temperature']}, top-p {run['top_p']})"
    print(f"saturated {name} bf16{graphs}, {run['streams']} streams of 128 in / 128 out: "
          f"{run['output_tokens_per_s']:,.0f} output tokens/s ({run['output_tokens']} tokens in "
          f"{run['seconds']:.1f} s, {run['steps']} steps; model {run['model_s']:.1f} s, schedule "
          f"{run['schedule_s']:.1f} s, sample {run['sample_s']:.1f} s)", flush=True)
    print(json.dumps(run))
    return run


def big_checkpoint(shape: dict, path: Path) -> str:
    if not (path / "config.json").exists():
        print(f"writing {path} (random bf16 weights)", flush=True)
        write_checkpoint(path, shape, num_shards=8 if shape["hidden_size"] >= 4096 else 1,
                         device="cuda" if torch.cuda.is_available() else "cpu")
        byte_level_tokenizer(shape["vocab_size"]).save(str(path / "tokenizer.json"))
    return str(path)


def fused_ops(args, small: str, path: str | None, eager: dict, graphed: dict) -> bool:
    """`cuda_fused_ops: on` (plugins/cuda_ops): the oracle again, then the saturated runs beside the ones above
    (with CUDA graphs where they ran). On the CPU `auto`, which leaves the model as it is: this code runs there too
    (tests/test_gpu_scripts.py), so that a GPU session is not spent on a typo in it."""
    fused = "on" if args.device == "cuda" else "auto"
    try:
        graphs = bool(graphed)
        ok = oracles(args.device, small, args.attention, graphs=False, fused=fused)
        if graphs:
            ok &= oracles(args.device, small, args.attention, graphs=True, fused=fused)
        for streams in args.streams if path is not None else []:
            run = report(args.big, saturated(args.device, path, streams, args.attention, graphs=graphs, fused=fused))
            before = (graphed if graphs else eager)[streams]["output_tokens_per_s"]
            print(f"fused CUDA ops / without at {streams} streams: {run['output_tokens_per_s'] / before:.2f}",
                  flush=True)
        return ok
    except Exception as exc:  # noqa: BLE001 (reported, and the check fails)
        print(f"fused CUDA ops FAILED: {type(exc).__name__}: {exc}", flush=True)
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--big", choices=["8b", "small"], default="8b")
    parser.add_argument("--streams", type=int, nargs="+", default=[256, 1024],
                        help="the saturated runs' numbers of requests (one run each)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="torch.profiler's tables for this many decode steps of one more run at the largest "
                             "--streams, after the timed ones (the profiler slows the steps it records)")
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--attention", choices=["auto", "native", "torch"], default="auto",
                        help="the engine's attention backend (torch: when the CUDA kernels failed their check)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    ok = True
    small = make_model(str(ROOT / "build/models/gpu-oracle"), TinySpec(hidden_size=256, intermediate_size=688,
                                                                      num_attention_heads=4, num_key_value_heads=2,
                                                                      seed=11))
    ok &= oracles(args.device, small, args.attention, graphs=False)
    ceiling = in_process(str(ROOT / "build/models/gpu-oracle"), 256, 32, 256)
    print(f"serving ceiling in process (engine null, 256 streams): {ceiling['tokens_per_s']:,.0f} tokens/s, "
          f"{ceiling['step_ms']:.3f} ms a step", flush=True)
    eager: dict = {}
    if not args.skip_big:
        shape = LLAMA_31_8B if args.big == "8b" else SMALL_BIG
        start = time.perf_counter()
        path = big_checkpoint(shape, ROOT / "build/models" / f"llama-{args.big}-shape")
        print(f"checkpoint ready in {time.perf_counter() - start:.0f} s", flush=True)
        for streams in args.streams:
            eager[streams] = report(args.big, saturated(args.device, path, streams, args.attention))
        most = args.streams[-1]  # every request sampled: the sampler's cost at the largest batch
        run = report(args.big, saturated(args.device, path, most, args.attention, temperature=0.8, top_p=0.9))
        print(f"sampled / greedy at {most} streams: "
              f"{run['output_tokens_per_s'] / eager[most]['output_tokens_per_s']:.2f}", flush=True)
    if args.profile and not args.skip_big:
        print(f"profile: {args.profile} decode steps at {args.streams[-1]} streams, eager (untimed run)", flush=True)
        saturated(args.device, path, args.streams[-1], args.attention, profile=args.profile)
    # CUDA graphs, then the fused ops, last: a failure there (a CUDA error spoils the process's context) loses
    # nothing above
    graphed = {}
    if args.device == "cuda" and args.attention != "torch":
        try:
            ok &= oracles(args.device, small, args.attention, graphs=True)
            if not args.skip_big:
                for streams in args.streams:
                    run = report(args.big, saturated(args.device, path, streams, args.attention, graphs=True))
                    graphed[streams] = run
                    print(f"CUDA graphs / eager at {streams} streams: "
                          f"{run['output_tokens_per_s'] / eager[streams]['output_tokens_per_s']:.2f}", flush=True)
        except Exception as exc:  # noqa: BLE001 (reported, and the check fails)
            print(f"CUDA graphs FAILED: {type(exc).__name__}: {exc}", flush=True)
            ok = False
    ok &= fused_ops(args, small, path if not args.skip_big else None, eager, graphed)
    print("ENGINE CHECKS OK" if ok else "ENGINE CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
