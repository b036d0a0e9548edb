"""PNG plots from serve_bench JSON results.

    .venv/bin/python -m benchmarks.plots benchmarks/results/load.json --out benchmarks/results/

- load.png: output tokens/s against p99 TTFT and p99 inter-token latency, one line per target across load points.
- timeline-TARGET.png: one run's batch composition over time (prefill and decode tokens per step, running and
  waiting requests), for every run that recorded a timeline.
- printed: the same composition as markdown tables (`benchmarks/timeline.py`), which docs/PERFORMANCE.md quotes.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.timeline import composition_table, step_kind_table  # noqa: E402


def load_plot(runs: list[dict], out: Path) -> Path:
    by_target = defaultdict(list)
    for run in runs:
        by_target[run["target"]].append(run)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for target, points in by_target.items():
        points.sort(key=lambda r: r["output_tokens_per_s"])
        tput = [p["output_tokens_per_s"] for p in points]
        axes[0].plot(tput, [p["ttft_p99_s"] for p in points], marker="o", label=target)
        axes[1].plot(tput, [p["itl_p99_s"] * 1e3 for p in points], marker="o", label=target)
    axes[0].set(xlabel="output tokens/s", ylabel="p99 TTFT (s)", yscale="log", title="throughput vs p99 TTFT")
    axes[1].set(xlabel="output tokens/s", ylabel="p99 inter-token latency (ms)", yscale="log",
                title="throughput vs p99 ITL")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_plot(run: dict, out: Path) -> Path:
    t, prefill, decode, running, waiting = zip(*run["timeline"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    top.stackplot(t, decode, prefill, labels=["decode tokens", "prefill tokens"], step="post")
    top.set(ylabel="tokens per step", title=f"{run['target']} ({run['load']}): batch composition")
    top.legend(fontsize=8, loc="upper right")
    bottom.step(t, running, where="post", label="running")
    bottom.step(t, waiting, where="post", label="waiting")
    bottom.set(xlabel="seconds", ylabel="requests")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    name = f"timeline-{run['target']}-{run['load']}"
    path = out / (re.sub(r"[^A-Za-z0-9.]+", "-", name) + ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for path in args.results for run in json.loads(Path(path).read_text())["runs"]]
    print(load_plot(runs, out))
    for run in runs:
        if run.get("timeline"):
            print(timeline_plot(run, out))
            print(composition_table(run))
            print(step_kind_table(run))


if __name__ == "__main__":
    main()
