"""Does the order of admission shorten a saturated run? The engine in process, every request of a workload
submitted at once, admitted first come first served against longest output first (each request's priority
its forced output length), in interleaved rounds.

    .venv/bin/python benchmarks/admission_order.py --checkpoint build/models/bench-large \
        --workload build/bench/var64.jsonl --repeat 2

Longest-first would help if the run's tail (steps with few sequences, each at the weight-streaming floor) came
from long requests admitted late; it prints each order's steps and how many of them ran fewer than 8 sequences.
Prefix caching is off, so every round computes every prompt.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import WorkItem, load  # noqa: E402
from inflight_backend import gc_tuning  # noqa: E402
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402

SMALL_BATCH = 8


def run(engine: InflightEngine, items: list[WorkItem], longest_first: bool, tag: str) -> dict:
    """Every item submitted at once, stepped to the end: seconds, tokens, steps, small steps, and the items'
    indices in the order they finished."""
    start = time.perf_counter()
    for i, item in enumerate(items):
        n = item.output_len
        engine.add_request(f"{tag}-{i}", item.prompt_ids, SamplingParams(max_tokens=n, min_tokens=n),
                           priority=n if longest_first else 0)
    tokens = steps = small = 0
    finished: list[int] = []
    while engine.has_unfinished():
        outputs = engine.step()
        tokens += sum(len(out.token_ids) for out in outputs)
        finished += [int(out.req_id.rsplit("-", 1)[1]) for out in outputs if out.finished]
        steps += 1
        small += engine.stats.num_running < SMALL_BATCH
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "steps": steps, "small": small, "finished": finished}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    items = load(args.workload)
    # priority_aging_s: long enough that no request's waiting time outweighs another's length in a run.
    engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, max_batch_size=args.max_batch_size,
                                         max_num_tokens=args.max_num_tokens, enable_kv_cache_reuse=False,
                                         priority_aging_s=1e6))
    gc_tuning.for_serving()
    print("| round | order | seconds | tokens/s | steps | steps with < 8 sequences |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in range(args.repeat):
        for longest_first in (False, True):
            got = run(engine, items, longest_first, f"{r}-{longest_first}")
            order = "longest output first" if longest_first else "first come first served"
            print(f"| {r + 1} | {order} | {got['seconds']:.2f} | {got['tokens'] / got['seconds']:.1f} | "
                  f"{got['steps']} | {got['small']} |", flush=True)


if __name__ == "__main__":
    main()
