"""Tables from a serve_bench run's step timeline (its `timeline`: per step, the time it ended, its prompt and
decode tokens, and the running and waiting requests; a step's time is the gap to the entry before it).

- by number of running sequences: where the run's time goes as the batch fills and drains;
- by kind of step (prompt only, decode only, mixed), with the time per prompt token: a mixed step that costs
  more per prompt token than a prompt-only one is doing its work badly.

    .venv/bin/python -m benchmarks.timeline benchmarks/results/RUN.json   (every run that recorded a timeline)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


RUNNING_BUCKETS = ((32, None), (16, 31), (8, 15), (1, 7))
STEP_KINDS = ("prompt only", "decode only", "mixed")


def _totals(run: dict, key, keys) -> dict:
    """{key: [seconds, steps, prompt tokens, decode tokens]} over the run's steps, each step under key(step)
    (None: not counted); `keys` fixes the rows and their order."""
    rows = {k: [0.0, 0, 0, 0] for k in keys}
    timeline = run["timeline"]
    for (before, *_), step in zip(timeline, timeline[1:]):
        row = rows.get(key(step))
        if row is not None:
            row[0] += step[0] - before
            row[1] += 1
            row[2] += step[1]
            row[3] += step[2]
    return rows


def _running_bucket(step):
    running = step[3]
    return next(((low, high) for low, high in RUNNING_BUCKETS if running >= low and (high is None or running <= high)),
                None)


def _step_kind(step):
    prefill, decode = step[1], step[2]
    return "mixed" if prefill and decode else "prompt only" if prefill else "decode only" if decode else None


def composition_table(run: dict) -> str:
    """Seconds, steps, decode and prefill tokens of one run, by how many sequences were running at each step."""
    lines = [f"{run['target']} ({run['load']}{', round ' + str(run['round'] + 1) if 'round' in run else ''}): "
             f"{run['duration_s']:.1f} s", "| running sequences | seconds | steps | decode tokens | prefill tokens |",
             "|---|---:|---:|---:|---:|"]
    for (low, high), (seconds, steps, prefill, decode) in _totals(run, _running_bucket, RUNNING_BUCKETS).items():
        label = f">= {low}" if high is None else f"{low}-{high}"
        lines.append(f"| {label} | {seconds:.2f} | {steps} | {decode} | {prefill} |")
    return "\n".join(lines)


def step_kind_table(run: dict) -> str:
    """Seconds, steps and tokens of one run by kind of step: prompt tokens only, decode tokens only, or both."""
    lines = ["| step kind | seconds | steps | prompt tokens | decode tokens | ms per step | us per prompt token |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, (seconds, steps, prefill, decode) in _totals(run, _step_kind, STEP_KINDS).items():
        if steps:
            per_token = f"{seconds / prefill * 1e6:.1f}" if prefill else ""
            lines.append(f"| {kind} | {seconds:.2f} | {steps} | {prefill} | {decode} | {seconds / steps * 1e3:.2f} | "
                         f"{per_token} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    args = parser.parse_args()
    for path in args.results:
        for run in json.loads(Path(path).read_text())["runs"]:
            if run.get("timeline"):
                print(composition_table(run))
                print(step_kind_table(run))
                print()


if __name__ == "__main__":
    main()
