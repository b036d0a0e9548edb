"""How `inflight serve` tells the models inside tritonserver to stop: Triton itself gives a Python model no
notice before `finalize()`, which it calls only once every open stream has ended.

The supervisor passes a stop-file path and its own pid in the environment; a model drains (ends every open
stream with an error, refuses new requests) once the file exists or the supervisor is gone.
"""
from __future__ import annotations

import os

STOP_FILE_ENV = "INFLIGHT_STOP_FILE"
SUPERVISOR_ENV = "INFLIGHT_SUPERVISOR_PID"


class StopSignal:
    """Set once `stop_file` exists or the process `supervisor_pid` is gone (either may be None: never)."""

    def __init__(self, stop_file: str | None = None, supervisor_pid: int | None = None) -> None:
        self.stop_file = stop_file
        self.supervisor_pid = supervisor_pid

    @classmethod
    def from_environment(cls) -> "StopSignal":
        pid = os.environ.get(SUPERVISOR_ENV)
        return cls(os.environ.get(STOP_FILE_ENV) or None, int(pid) if pid else None)

    def is_set(self) -> bool:
        if self.stop_file is not None and os.path.exists(self.stop_file):
            return True
        if self.supervisor_pid is not None:
            try:
                os.kill(self.supervisor_pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # alive, another user's (cannot happen for our own parent; harmless)
                pass
        return False
