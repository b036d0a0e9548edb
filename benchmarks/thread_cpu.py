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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import proc_stat  # noqa: E402


def threads(match: list[str]) -> dict[tuple[str, int, int], float]:
    """{(process label, pid, tid): CPU seconds so far (user + system)} of every matching process's threads."""
    found = {}
    for pid in proc_stat.pids():
        if pid == os.getpid():  # (this process's own arguments match)
            continue
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        label = next((m for m in match if any(m in word for word in words)), None)
        if label is not None:
            found.update({(label, pid, tid): proc_stat.stat(pid, tid)[1] for tid in tids})
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
        used = {key: cpu - before.get(key, 0.0) for key, cpu in now.items() if cpu > before.get(key, 0.0)}
        before = now
        if not used:
            continue
        per_process: dict[str, float] = {}
        for (label, pid, _), seconds in used.items():
            per_process[f"{label} {pid}"] = per_process.get(f"{label} {pid}", 0.0) + seconds
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:args.top]
        print(f"{time.monotonic() - start:6.1f} s  processes: "
              + ", ".join(f"{name} {100 * seconds:.0f}" for name, seconds in sorted(per_process.items()))
              + "  |  threads: " + ", ".join(f"{label}/{tid} {100 * seconds:.0f}"
                                            for (label, _, tid), seconds in busiest), flush=True)


if __name__ == "__main__":
    main()
