"""Where a serving run's CPU goes, thread by thread: samples /proc once a second and prints, for each second, the
CPU each thread of the matching processes used (in hundredths of a core) and each process's total. Run it beside
a benchmark on the same machine:

    .venv/bin/python benchmarks/thread_cpu.py --seconds 60 --match tritonserver model.py serve_bench &
    .venv/bin/python -m benchmarks.serve_bench --checkpoint build/models/bench-medium \
        --workload build/bench/var64.jsonl --max-batch-size 32 --max-num-tokens 2048 --targets triton:fused

A process matches when its command line contains one of the `--match` strings (the model's stub carries the
model's path: `model.py`). Threads are named by process and thread id; Python threads share their process's
name, so tell them apart by their share (the engine's compute threads, the responder, gRPC's).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def threads(match: list[str]) -> dict[tuple[str, int, int], int]:
    """{(process label, pid, tid): CPU ticks so far (user + system)} of every matching process's threads."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():  # (this process's own arguments match)
            continue
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        label = next((m for m in match if any(m in word for word in words)), None)
        if label is None:
            continue
        try:
            tids = os.listdir(f"/proc/{entry}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = Path(f"/proc/{entry}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[(label, int(entry), int(tid))] = int(fields[11]) + int(fields[12])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--match", nargs="+", default=["tritonserver", "model.py", "serve_bench"])
    parser.add_argument("--top", type=int, default=6, help="threads shown a second, busiest first")
    args = parser.parse_args()
    start = time.monotonic()
    before = threads(args.match)
    while time.monotonic() - start < args.seconds:
        time.sleep(1.0)
        now = threads(args.match)
        used = {key: ticks - before.get(key, 0) for key, ticks in now.items() if ticks > before.get(key, 0)}
        before = now
        if not used:
            continue
        per_process: dict[str, int] = {}
        for (label, pid, _), ticks in used.items():
            per_process[f"{label} {pid}"] = per_process.get(f"{label} {pid}", 0) + ticks
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:args.top]
        scale = 100 / TICKS
        print(f"{time.monotonic() - start:6.1f} s  processes: "
              + ", ".join(f"{name} {ticks * scale:.0f}" for name, ticks in sorted(per_process.items()))
              + "  |  threads: " + ", ".join(f"{label}/{tid} {ticks * scale:.0f}"
                                            for (label, _, tid), ticks in busiest), flush=True)


if __name__ == "__main__":
    main()
