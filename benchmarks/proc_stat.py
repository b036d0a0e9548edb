"""CPU time from /proc: every process id, and a process's or thread's parent and CPU seconds so far (user +
system), the one parser of `/proc/.../stat` lines the benchmarks share."""
from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def stat(pid: int, tid: int | None = None) -> tuple[int, float]:
    """(parent pid, CPU seconds: user + system) of process `pid`, or of its thread `tid`; (0, 0.0) once gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()  # (the command name may hold spaces)
    except OSError:
        return 0, 0.0
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the tritonserver process `pid` and of its stub processes."""
    children = [(parent, cpu) for parent, cpu in map(stat, pids()) if parent == pid]
    return {"tritonserver": stat(pid)[1], "stub": sum(cpu for _, cpu in children)}
