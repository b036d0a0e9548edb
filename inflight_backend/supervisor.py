"""`inflight serve`'s supervisor: it owns tritonserver, restarts it when a model's stub dies, and stops it
gracefully on SIGTERM or Ctrl-C.

Why a supervisor: when a Python backend stub dies after `execute()` returned, Triton 2.51 notices nothing: its
open streams never end, readiness still answers 200, every new request fails, nothing restarts the stub and
shutdown waits out the exit timeout. Killing tritonserver ends those streams at once (each client sees its
stream fail) and a fresh server brings the model back.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from .server import ServerError, TritonServer

POLL_S = 0.5
_LOG_PREFIX = "inflight: "


def log(message: str) -> None:
    print(_LOG_PREFIX + message, file=sys.stderr, flush=True)


class Supervisor:
    """Runs the server `make_server()` returns until asked to stop.

    A dead stub (or a server that exits on its own) gets the server killed and started again, at most
    `max_restarts` times within `restart_window_s` seconds; beyond that `run()` returns non-zero, for a process
    manager to act on. SIGTERM or SIGINT: drain (every open stream ends with an error saying the server is
    stopping), stop tritonserver, return its exit code (0 when it stopped cleanly)."""

    def __init__(self, make_server: Callable[[], TritonServer], on_ready: Callable[[TritonServer], None],
                 max_restarts: int = 5, restart_window_s: float = 600.0, stop_timeout_s: float = 15.0) -> None:
        self._make_server, self._on_ready = make_server, on_ready
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.stop_timeout_s = stop_timeout_s
        self._stop = threading.Event()
        self._restarts: list[float] = []

    def request_stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        server = self._start()
        while True:
            fault = self._watch(server)
            if fault is None:  # asked to stop
                return self._stop_server(server)
            log(fault + ": killing tritonserver (its open streams end with an error)")
            server.kill()
            if not self._may_restart():
                log(f"{len(self._restarts)} restarts within {self.restart_window_s:.0f}s: giving up")
                return 1
            log("restarting tritonserver")
            server = self._start()

    def _stop_server(self, server: TritonServer) -> int:
        """Drain and stop. A client that keeps its gRPC stream open after its requests ended pins the model in
        Triton 2.51 (it waits for the stream to close, past its exit timeout, then hangs); once every stream
        has ended there is nothing left to lose, so such a server is killed after `stop_timeout_s`."""
        code = server.stop(self.stop_timeout_s)
        if code == -signal.SIGKILL:
            log(f"tritonserver had not exited {self.stop_timeout_s:.0f}s after every stream ended (clients still "
                "hold idle gRPC streams open, which Triton waits for): killed it")
            return 0
        log(f"tritonserver stopped (exit code {code})")
        return code or 0

    def _start(self) -> TritonServer:
        server = self._make_server()
        server.start()
        self._on_ready(server)
        return server

    def _watch(self, server: TritonServer) -> str | None:
        """Block until asked to stop (None) or until something fails (a sentence saying what)."""
        stubs = server.stub_pids()
        while not self._stop.wait(POLL_S):
            if (code := server.started().poll()) is not None:
                return f"tritonserver exited on its own with code {code}"
            if dead := stubs - server.stub_pids():
                return f"model stub process {sorted(dead)} died"
        return None

    def _may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < self.restart_window_s] + [now]
        return len(self._restarts) <= self.max_restarts


def run_supervised(make_server: Callable[[], TritonServer], on_ready: Callable[[TritonServer], None],
                   max_restarts: int, stop_timeout_s: float) -> int:
    try:
        return Supervisor(make_server, on_ready, max_restarts, stop_timeout_s=stop_timeout_s).run()
    except ServerError as exc:
        log(str(exc))
        return 1
