"""Serving benchmark: several systems, one checkpoint, one workload, one run.

    .venv/bin/python -m benchmarks.serve_bench --checkpoint build/models/bench-small \\
        --workload build/bench/workload.jsonl --mode saturation \\
        --targets engine:static engine:prefill_first engine:fused engine:fused+chunked triton:fused hf:static hf:batch

Targets: `engine:POLICY[+chunked][+noreuse]` (in-process), `triton:POLICY[+chunked][+noreuse]` (a real
tritonserver, gRPC streaming); `+noreuse` turns prefix caching (`enable_kv_cache_reuse`) off, `+cacheaware`
admits longest cached prefix first (`cache_aware_admission_ms` 1000), `+noamx` keeps prefill GEMMs off AMX
(`amx_gemm: off`), `+noscreen` computes every LM head whole (`greedy_screen: off`: in fp32, or a bf16 model's
in bf16), `+http` streams a triton target over HTTP `/generate_stream` with the peers' client (every output,
text included) instead of gRPC; `+chunkedN` sets that target's token budget to N instead of
--chunked-max-num-tokens, `+chunkedNcapC` also caps one request's prompt tokens per step at C
(`max_chunk_tokens`); `+stepMS` (with `+chunked...`, whose budget is then the ceiling) sizes each step's budget
to run in MS milliseconds (`step_time_target_ms`); `hf:static` (transformers `generate`, static batches),
`hf:batch` (transformers' continuous batching); the peers `vllm:x[+chunkedN][+noreuse]` (N: its
--max-num-batched-tokens with chunked prefill; `+noreuse`: its prefix caching off, which poisson runs need: each
rate sends the same prompts again) and `llamacpp:x` (make bench-peers).
Modes: `saturation` (everything arrives at once), `poisson --rates R ...` (open loop, requests/s),
`concurrency --concurrency N ...` (closed loop). TTFT counts from each request's scheduled arrival.
Before timing, every target but `hf:` (which is transformers) answers 4 prompts greedily and must give
transformers' tokens. `--temperature T [--top-p P]`: the timed requests of the engine, triton and peer targets
sample (llama.cpp's other samplers, top-k and min-p, off), each request unseeded. Writes every run's metrics as
JSON (`--out`) and prints a markdown table.

`--baseline REV` times an older commit side by side: each round runs REV's own serve_bench (in a worktree,
build/baseline/COMMIT, its native kernels built there) and this tree's, each in a fresh process with the same
arguments and one round, REV first in even rounds and this tree first in odd ones; targets are reported as
`TARGET@COMMIT`, with this tree's figure over REV's per round and the median.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import targets as T  # noqa: E402
from benchmarks.baseline_tree import ROOT, baseline_tree, commit_label, without_options  # noqa: E402
from benchmarks import triton_target  # noqa: E402
from benchmarks.records import summarize  # noqa: E402
from benchmarks.run_tables import ratio_table, table  # noqa: E402
from benchmarks.workload import WorkItem, load  # noqa: E402


def make_target(spec: str, args, workdir: Path):
    system, _, policy = spec.partition(":")
    sampling = (args.temperature, args.top_p)
    if system in ("vllm", "llamacpp"):  # the peers (make bench-peers), in --dtype
        from benchmarks import peer_targets as P
        from inflight_backend.server import free_port

        _, *flags = policy.split("+")
        chunked = next((f for f in flags if f.startswith("chunked")), "")
        budget, cap = chunk_budget(chunked, args.chunked_max_num_tokens) if chunked else (0, 0)
        if system != "vllm" and flags or cap or set(flags) - {chunked, "noreuse"}:
            raise SystemExit(f"{spec}: a peer takes no suffix but vLLM's +chunkedN and +noreuse")
        if system == "vllm":
            return P.VLLMTarget(args.checkpoint, workdir, free_port(), args.max_batch_size, args.max_num_tokens,
                                chunk_budget=budget, prefix_caching="noreuse" not in flags, sampling=sampling,
                                dtype=args.dtype)
        return P.LlamaCppTarget(args.checkpoint, workdir, free_port(), args.max_batch_size, sampling=sampling,
                                dtype=args.dtype)
    if system == "hf":
        if sampling != (0.0, 1.0):
            raise SystemExit(f"{spec}: --temperature / --top-p apply to the engine, triton and peer targets only")
        cls = {"static": T.HFStaticTarget, "batch": T.HFContinuousTarget}[policy]
        return cls(args.checkpoint, args.max_batch_size, args.dtype)
    name, *flags = policy.split("+")
    unknown = [f for f in flags if f not in ("noreuse", "cacheaware", "noamx", "noscreen", "http")
               and not f.startswith("chunked")
               and not (f.startswith("step") and f[4:].isdigit())]
    if unknown:
        raise SystemExit(f"unknown target suffix(es) {unknown}")
    step_ms = next((float(f[4:]) for f in flags if f.startswith("step")), 0.0)
    reuse = "noreuse" not in flags
    chunked = next((f for f in flags if f.startswith("chunked")), "")
    budget, cap = chunk_budget(chunked, args.chunked_max_num_tokens) if chunked else (args.max_num_tokens, 0)
    params = dict(batching_policy=name, enable_chunked_prefill=bool(chunked), max_batch_size=args.max_batch_size,
                  max_num_tokens=budget, max_chunk_tokens=cap, block_size=args.block_size,
                  num_kv_blocks=args.num_kv_blocks, max_queue_delay_ms=args.max_queue_delay_ms, dtype=args.dtype,
                  linear_backend=args.linear_backend, amx_gemm="off" if "noamx" in flags else "auto",
                  greedy_screen="off" if "noscreen" in flags else "auto",
                  enable_kv_cache_reuse=reuse,
                  cache_aware_admission_ms=1000.0 if "cacheaware" in flags else 0.0, step_time_target_ms=step_ms)
    if system == "engine":
        return T.EngineTarget(args.checkpoint, sampling=sampling, **params)
    if system == "triton":
        params["enable_chunked_prefill"] = str(bool(chunked)).lower()
        params["enable_kv_cache_reuse"] = str(reuse).lower()
        return triton_target.TritonTarget(args.checkpoint, workdir / spec.replace(":", "-").replace("+", "-"),
                                          sampling=sampling, transport="http" if "http" in flags else "grpc",
                                          **params)
    raise SystemExit(f"unknown target {spec!r}")


def chunk_budget(suffix: str, default: int) -> tuple[int, int]:
    """(token budget, per-request chunk cap) of a `+chunked`, `+chunkedN` or `+chunkedNcapC` target."""
    budget, sep, cap = suffix.removeprefix("chunked").partition("cap")
    valid = suffix.startswith("chunked") and (budget == "" or budget.isdigit()) and (not sep or cap.isdigit())
    if not valid:
        raise SystemExit(f"unknown target suffix +{suffix}: use +chunked, +chunkedN (N tokens per step) or "
                         "+chunkedNcapC (at most C of them for one request)")
    return int(budget) if budget else default, int(cap) if cap else 0


def arrival_sets(args, n: int):
    """(label, arrivals, concurrency) for each load point of the chosen mode."""
    if args.mode == "saturation":
        return [("saturation", [0.0] * n, None)]
    if args.mode == "concurrency":
        return [(f"concurrency={c}", [0.0] * n, c) for c in args.concurrency]
    points = []
    for rate in args.rates:
        rng, t, arrivals = random.Random(args.seed), 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            arrivals.append(t)
        points.append((f"rate={rate:g}/s", arrivals, None))
    return points


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--mode", choices=["saturation", "poisson", "concurrency"], default="saturation")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--chunked-max-num-tokens", type=int, default=256,
                        help="token budget per step for +chunked targets (SplitFuse's fixed-size iterations)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=0)
    parser.add_argument("--max-queue-delay-ms", type=float, default=10.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of every target, ours and Hugging Face's")
    parser.add_argument("--linear-backend", default="auto", choices=["auto", "native", "torch"],
                        help="our engine's CPU linear layers (engine and triton targets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the timed requests sample at this temperature (0: greedy); the greedy checks stay greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="and this top-p")
    parser.add_argument("--warmup", type=int, default=4, help="requests run (and discarded) before measuring")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds: every target runs once per round, in turn, so slow phases of a noisy machine "
                             "hit all targets; ratios are taken within each round")
    parser.add_argument("--load-fraction", type=float, default=0.0,
                        help="instead of --rates (and whatever --mode): each round first runs the first target at "
                             "saturation, then every target under Poisson arrivals at this fraction of the "
                             "requests/s it reached")
    parser.add_argument("--ratios", nargs="+", default=[], metavar="A/B",
                        help="print target A's metric over target B's, per round and their median")
    parser.add_argument("--ratio-metrics", nargs="+", default=["output_tokens_per_s"], metavar="METRIC",
                        help="summary fields the ratios compare (e.g. itl_p99_s ttft_p50_s)")
    parser.add_argument("--out", help="write all runs as JSON here")
    parser.add_argument("--baseline", metavar="REV", help="an older commit to time side by side (module docstring)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.baseline:
        return against_baseline(args, argv)
    items = load(args.workload)
    runs = []
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        for rnd in range(args.repeat):
            round_args = args
            if args.load_fraction:
                saturated = run_target(args.targets[0], argparse.Namespace(**{**vars(args), "mode": "saturation"}),
                                       Path(tmp), items, rnd)
                runs.extend(saturated)
                rate = args.load_fraction * saturated[0]["requests_per_s"]
                round_args = argparse.Namespace(**{**vars(args), "mode": "poisson", "rates": [round(rate, 2)]})
            for spec in args.targets:
                runs.extend(run_target(spec, round_args, Path(tmp), items, rnd))
    print(table(runs))
    for metric in args.ratio_metrics if args.ratios else []:
        print()
        print(ratio_table(runs, [tuple(pair.split("/")) for pair in args.ratios], metric))
    _write(args, runs)
    return runs


def _write(args, runs: list[dict]) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


def against_baseline(args, argv: list[str]) -> list[dict]:
    """--baseline: both trees' rounds, their table, and this tree's figure over REV's for every target."""
    tree = baseline_tree(args.baseline)
    old, new = commit_label(tree), commit_label()
    runs = side_by_side(args, argv, [(old, tree), (new, ROOT)])
    print(table(runs))
    for metric in args.ratio_metrics:
        print()
        print(ratio_table(runs, [(f"{spec}@{new}", f"{spec}@{old}") for spec in args.targets], metric))
    _write(args, runs)
    return runs


def side_by_side(args, argv: list[str], sides: list[tuple[str, Path]]) -> list[dict]:
    """--baseline: every round, each side's serve_bench ((label, tree): REV's, then this one's) once in a fresh
    process, in turns; its targets renamed TARGET@label."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        for rnd in range(args.repeat):
            for label, root in sides if rnd % 2 == 0 else sides[::-1]:
                out = Path(tmp) / f"{rnd}-{label}.json"
                subprocess.run([sys.executable, "-m", "benchmarks.serve_bench", *child_argv(argv, args), "--out",
                                str(out)], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                               stdout=subprocess.DEVNULL, check=True)
                runs += [{**run, "target": f"{run['target']}@{label}", "round": rnd}
                         for run in json.loads(out.read_text())["runs"]]
    return runs


def child_argv(argv: list[str], args) -> list[str]:
    """The arguments of one side's round: these, less --baseline, --repeat and --out, with one round and the
    checkpoint and workload as absolute paths (each side runs in its own tree)."""
    kept = without_options(argv, {"--baseline", "--repeat", "--out", "--checkpoint", "--workload"})
    return [*kept, "--checkpoint", str(Path(args.checkpoint).resolve()), "--workload",
            str(Path(args.workload).resolve()), "--repeat", "1"]


def run_target(spec: str, args, workdir: Path, items, rnd: int) -> list[dict]:
    """Start `spec`, warm it up, run every load point, stop it."""
    runs = []
    target = make_target(spec, args, workdir)
    try:
        if hasattr(target, "greedy_ids"):  # ours and the peers: greedy tokens must be transformers' before timing
            # the warm-up's prompts (reversed): a server that caches prefixes keeps nothing the timed run sends
            cases = [(item.prompt_ids[::-1], 16) for item in items[:4]]
            agree = T.check_greedy(target, args.checkpoint, cases, args.dtype)
            same = sum(n == want for n, want, _ in agree)
            worst = max(gap for _, _, gap in agree)
            print(f"{spec}: {same} of {len(agree)} greedy outputs equal transformers' ({args.dtype}); tokens in "
                  f"common: {' '.join(f'{n}/{want}' for n, want, _ in agree)}; worst choice {worst:g} bf16 "
                  "spacings below transformers' best", file=sys.stderr)
            # In bf16 every kernel sums in its own order and rounds each layer's outputs (logits near 100 are 0.5
            # apart): greedy paths part where two logits lie within that. There each of the server's tokens must
            # be within two bf16 spacings of transformers' best logit, teacher-forced on the server's own ids.
            failed = same != len(agree) if args.dtype == "float32" else worst > 2.0
            if failed:
                raise SystemExit(f"{spec}: greedy outputs differ from transformers'; not timed")
        # Warm-up prompts are the first items reversed: nothing of them is left for the measured run to reuse.
        warmup = [WorkItem(item.prompt_ids[::-1], item.output_len) for item in items[: args.warmup]]
        target.run(warmup, [0.0] * len(warmup))
        for label, arrivals, concurrency in arrival_sets(args, len(items)):
            records, extra = target.run(items, arrivals, concurrency)
            runs.append({"target": spec, "load": label, "round": rnd, **summarize(records, extra),
                         "timeline": getattr(target, "timeline", [])})
            cpu = " ".join(f"{k} {v:.1f}" for k, v in runs[-1].get("cpu_seconds", {}).items())
            print(f"round {rnd} {spec:24s} {label:16s} {runs[-1]['output_tokens_per_s']:9.1f} tok/s  "
                  f"{runs[-1]['duration_s']:.1f} s{'  CPU s: ' + cpu if cpu else ''}", file=sys.stderr)
    finally:
        if hasattr(target, "stop"):
            target.stop()
    return runs


if __name__ == "__main__":
    main()
