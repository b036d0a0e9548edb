"""How `inflight serve` tells the models inside tritonserver to stop: Triton itself gives a Python model no
notice before `finalize()`, which it calls only once every open stream has ended.

The supervisor passes a stop-file path and its own pid in the environment; a model drains (ends every open
stream with an error, refuses new requests) once the file exists or the supervisor is gone (tritonserver also
gets SIGTERM then, as its parent-death signal; the drain is what lets it exit).
"""
from __future__ import annotations

import os

STOP_FILE_ENV = "INFLIGHT_STOP_FILE"
SUPERVISOR_ENV = "INFLIGHT_SUPERVISOR_PID"


class StopSignal:
    """Set once `stop_file` exists or the supervisor has died: it is no longer the parent of `server_pid`
    (tritonserver, this stub's parent), which holds from its death on, even while it waits, a zombie, to be
    reaped. Either may be None: never set that way."""

    def __init__(self, stop_file: str | None = None, supervisor_pid: int | None = None,
                 server_pid: int | None = None) -> None:
        self.stop_file = stop_file
        self.supervisor_pid = supervisor_pid
        self.server_pid = server_pid if server_pid is not None else os.getppid()

    @classmethod
    def from_environment(cls) -> StopSignal:
        pid = os.environ.get(SUPERVISOR_ENV)
        return cls(os.environ.get(STOP_FILE_ENV) or None, int(pid) if pid else None)

    def is_set(self) -> bool:
        if self.stop_file is not None and os.path.exists(self.stop_file):
            return True
        return self.supervisor_pid is not None and _parent_of(self.server_pid) != self.supervisor_pid


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
