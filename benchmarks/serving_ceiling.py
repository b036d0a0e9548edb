"""The serving path's ceiling: how many tokens per second the backend delivers when the model costs nothing.

    .venv/bin/python benchmarks/serving_ceiling.py [--checkpoint build/models/tiny-llama] [--streams 32 128 256 512]
        [--prompt-len 32] [--output-len 256] [--transports inprocess inprocess-ids grpc http] [--clients 4]
        [--baseline REV] [--json OUT]

Every run uses `engine: null` (runners/null_runner.py): logits are fixed, so scheduling, sampling, detokenizing,
building responses and Triton's transport are all that is measured. Each stream is one request of --prompt-len
prompt tokens forced to --output-len output tokens (min_tokens), all submitted at once.

- inprocess: InflightEngine.step() in a loop, no threads, no server (the engine's own ceiling), with the step's
  split into schedule / model / sample-and-postprocess; every token detokenized (as for the HTTP clients).
- inprocess-ids: the same, ids only (no detokenizing: as for the gRPC clients, which read `output_ids` alone).
  Both run with the garbage collector set as the Triton model sets it (inflight_backend/gc_tuning.py).
- grpc: a real tritonserver; --clients client processes, each with one gRPC stream carrying its share of the
  requests, reading `output_ids` only.
- http: the same server; --clients processes, each with one thread per request on /generate_stream (SSE).
- grpc-batched: as grpc, to a second model in TensorRT-LLM's batched layout (max_batch_size = the most streams)
  with Triton's dynamic batcher (no queue delay): execute() takes every request queued while the last call ran,
  where the unbatched model takes them one at a time.

For Triton transports: tokens/s over the wall time from the first request to the last final response, and CPU
seconds per 1,000 tokens of tritonserver, of the model's stub process, and of the clients (all processes share
this machine's cores: the client's share shows whether it, not the server, was the limit).

--baseline REV runs this same script against a git worktree of REV (build/baseline/COMMIT, made once, its native
kernels built there: its backend, engine and server code, in their own processes) and against this tree, round
by round (REV then this, this then REV, ... for --repeat rounds, so a slow phase of this noisy machine hits both
and neither always goes first), and
prints both side by side with the ratio of their median rounds. REV needs `engine: null` (528449f or later).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# The tree whose backend is measured: this one, or (--baseline) a worktree of an older commit.
ROOT = Path(os.environ.get("SERVING_CEILING_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

# The clients and the /proc reader are this script's (harness, not backend): imported from beside it even when ROOT
# is a baseline tree, by top-level names that the spawned client processes find on the sys.path they inherit.
sys.path.append(str(Path(__file__).resolve().parent))

from baseline_tree import baseline_tree, commit_label  # noqa: E402
from ceiling_clients import grpc_client, http_client  # noqa: E402
from ceiling_report import IN_PROCESS, median_rounds, notes, table  # noqa: E402
from proc_stat import server_cpu  # noqa: E402
from inflight_backend.block_manager import blocks_for  # noqa: E402
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402

try:
    from inflight_backend import gc_tuning  # noqa: E402
except ImportError:  # an older tree (--baseline)
    gc_tuning = None

BLOCK = 16


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


ENGINE = "null"  # --engine
EXTRA: dict = {}  # --param KEY=VALUE: more model parameters, for the Triton runs


def engine_params(max_streams: int, prompt_len: int, output_len: int) -> dict:
    return dict(engine=ENGINE, max_batch_size=max_streams, max_num_tokens=max(1024, max_streams),
                num_kv_blocks=max_streams * blocks_for(prompt_len + output_len, BLOCK) + 8, block_size=BLOCK,
                default_max_tokens=output_len)


def in_process(checkpoint: str, streams: int, prompt_len: int, output_len: int, text: bool = True) -> dict:
    """`text`: detokenize every token (as for the HTTP clients, which get every output); else ids only (as for the
    gRPC clients, which ask for `output_ids` alone)."""
    engine = InflightEngine(EngineConfig(checkpoint=checkpoint, **engine_params(streams, prompt_len, output_len)))
    if gc_tuning is not None:
        gc_tuning.for_serving()  # as the Triton model does (an older tree under --baseline may not have it)
    if not text and "detokenize" not in SamplingParams.__dataclass_fields__:
        raise SystemExit("inprocess-ids needs SamplingParams.detokenize (6f5b731 or later)")
    ids_only = {} if text else {"detokenize": False}
    for i, ids in enumerate(prompts(streams, prompt_len, engine.runner.vocab_size)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=output_len, min_tokens=output_len, **ids_only))
    tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    s = engine.stats
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "steps": s.num_steps,
            "step_ms": 1000 * wall / max(s.num_steps, 1),
            "split_ms": {"schedule": 1000 * s.schedule_seconds / s.num_steps,
                         "model": 1000 * s.model_seconds / s.num_steps,
                         "sample": 1000 * s.sample_seconds / s.num_steps},
            "cpu_ms_per_1k": {"engine": 1e6 * cpu / tokens}}


def through_triton(server, transport: str, streams: int, prompt_len: int, output_len: int, clients: int,
                   vocab: int) -> dict:
    ctx = mp.get_context("spawn")
    # every client imported, connected and holding its requests before the clock starts (a fixed sleep was too
    # short for 8 spawned clients on 2 cores: their imports ran into the timed run)
    ready, start, results = ctx.Barrier(clients + 1), ctx.Event(), ctx.Queue()
    requests = [(str(i), ids) for i, ids in enumerate(prompts(streams, prompt_len, vocab))]
    grpc = transport.startswith("grpc")
    target = grpc_client if grpc else http_client
    port = server.grpc_port if grpc else server.http_port
    extra = (transport == "grpc-batched",) if grpc else ()
    procs = [ctx.Process(target=target,
                         args=(port, requests[c::clients], output_len, ready, start, results, *extra))
             for c in range(clients)]
    for p in procs:
        p.start()
    ready.wait(timeout=300)
    model = "bench_batched" if transport == "grpc-batched" else "bench"
    calls_before = _executions(server, model)
    before = server_cpu(server.process.pid)
    t0 = time.perf_counter()
    start.set()
    outs = [results.get(timeout=900) for _ in procs]
    wall = max(o["end"] for o in outs) - t0
    after = server_cpu(server.process.pid)
    executions = _executions(server, model) - calls_before
    for p in procs:
        p.join()
    tokens = sum(o["tokens"] for o in outs)
    errors = [e for o in outs for e in o["errors"]]
    gaps = sorted(g for o in outs for g in o.get("gaps", []))
    cpu = {k: after[k] - before[k] for k in after}
    cpu["client"] = sum(o["cpu"] for o in outs)
    return {"tokens": tokens, "expected_tokens": streams * output_len, "seconds": wall, "tokens_per_s": tokens / wall,
            "cpu_ms_per_1k": {k: 1e6 * v / max(tokens, 1) for k, v in cpu.items()},
            "cpu_share": {k: v / wall for k, v in cpu.items()}, "errors": errors[:3], "executions": executions,
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None}


def _executions(server, model: str) -> int:
    """How many execute() calls Triton has made on `model` so far (its statistics extension)."""
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/stats", timeout=30) as reply:
        return int(json.load(reply)["model_stats"][0].get("execution_count", 0))


def measure(args) -> dict:
    """Every (transport, streams) --repeat times, round after round; each row is its round of median tokens/s,
    with every round's figure in `rounds`."""
    return median_rounds([_measure_once(args) for _ in range(args.repeat)])


def _measure_once(args) -> dict:
    results: dict = {"commit": commit_label(ROOT), "runs": []}
    for transport in [t for t in args.transports if t in IN_PROCESS]:
        for n in args.streams:
            r = in_process(args.checkpoint, n, args.prompt_len, args.output_len, text=transport == "inprocess")
            results["runs"].append({"transport": transport, "streams": n, **r})
            _progress(results["runs"][-1])
    remote = [t for t in args.transports if t not in IN_PROCESS]
    if remote:
        from inflight_backend.repository import model_config, write_repository
        from inflight_backend.server import TritonServer, free_port

        workdir = ROOT / "build" / "serving_ceiling"
        params = {**engine_params(max(args.streams), args.prompt_len, args.output_len), **EXTRA}
        models = {"bench": model_config(args.checkpoint, "bench", **params)}
        if "grpc-batched" in remote:
            models["bench_batched"] = model_config(args.checkpoint, "bench_batched", max(args.streams),
                                                   dynamic_batching="", **params)
        repo = write_repository(workdir / "repo", models)
        server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=workdir / "tritonserver.log")
        server.start()
        try:
            vocab = _vocab(args.checkpoint)
            for transport in remote:
                for n in args.streams:
                    r = through_triton(server, transport, n, args.prompt_len, args.output_len, args.clients, vocab)
                    results["runs"].append({"transport": transport, "streams": n, **r})
                    _progress(results["runs"][-1])
        finally:
            server.stop()
    return results


def _vocab(checkpoint: str) -> int:
    from inflight_backend.checkpoint import load_config

    return load_config(checkpoint).vocab_size


def _progress(run: dict) -> None:
    print(f"  {run['transport']:9s} {run['streams']:4d} streams: {run['tokens_per_s']:9.0f} tokens/s", file=sys.stderr,
          flush=True)


def baseline(args) -> dict:
    """Run this script against a worktree of args.baseline (made once under build/baseline/); its results."""
    tree = baseline_tree(args.baseline)
    out = tree / "build" / "serving_ceiling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--checkpoint", args.checkpoint, "--streams", *map(str, args.streams), "--prompt-len",
            str(args.prompt_len), "--output-len", str(args.output_len), "--transports", *args.transports,
            "--clients", str(args.clients), "--engine", args.engine, "--repeat", str(args.repeat), "--json", str(out)]
    argv += [a for p in args.param for a in ("--param", p)]
    env = {**os.environ, "PYTHONPATH": str(tree), "SERVING_CEILING_TREE": str(tree)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "build/models/tiny-llama"))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128, 256, 512])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--transports", nargs="+", default=["inprocess", "inprocess-ids", "grpc", "http"],
                        choices=[*IN_PROCESS, "grpc", "grpc-batched", "http"])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; tables show each row's median round")
    parser.add_argument("--engine", default="null", choices=["null", "pytorch"],
                        help="pytorch: the real model instead (for latency with a model that takes time)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a model parameter for the Triton runs (repeatable)")
    parser.add_argument("--baseline", help="a git revision to measure side by side (from its own worktree)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.checkpoint = str(Path(args.checkpoint).resolve())
    global ENGINE
    ENGINE = args.engine
    EXTRA.update(p.split("=", 1) for p in args.param)
    if args.baseline:  # rounds interleaved, each tree first in turn: a slow phase of the machine hits both
        old, new = [], []
        for rnd in range(args.repeat):
            if rnd % 2:
                new.append(_measure_once(args))
            old.append(baseline(argparse.Namespace(**{**vars(args), "repeat": 1})))
            if not rnd % 2:
                new.append(_measure_once(args))
        results = [median_rounds(old), median_rounds(new)]
    else:
        results = [measure(args)]
    if args.json:
        Path(args.json).write_text(json.dumps(results[-1], indent=2))
    print(table(results))
    for line in notes(results):
        print(line)

if __name__ == "__main__":
    main()
