"""Noticing, off the hot path, that a client has gone (and, each tick, whether the server is stopping).

Triton pushes no cancellation: each `is_cancelled()` is an IPC round trip to tritonserver (python_backend
releases the GIL while it waits, and the answer stays true once true). One thread asks about every open stream
each tick, so a cancelled or disconnected client is seen within a tick and its request ends at the next step
boundary; the responder thread never waits on these round trips.
"""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

Senders = Callable[[], "list[tuple[str, Callable[[], bool]]]"]


class CancelWatcher:
    """Every `tick` seconds: `on_tick()`, then `cancel(req_id)` once for each open stream whose `is_cancelled()`
    says so; ticks take at most `max_share` of the time. `open_senders()` returns (req_id, is_cancelled) pairs:
    the caller guards each sender."""

    def __init__(self, open_senders: Senders, cancel: Callable[[str], None], on_tick: Callable[[], None],
                 tick: float, max_share: float = 1.0) -> None:
        self._open_senders, self._cancel, self._on_tick, self._tick = open_senders, cancel, on_tick, tick
        self._rest = 1.0 / max_share - 1.0  # seconds waited per second a tick took
        self._cancelled: set[str] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-cancel-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        """Ticks start every `tick` seconds, or later when sweeps are long: ticks take at most `max_share` of the
        time (with 0.1, the model's default: at 64 streams a sweep takes ~10 ms, ~0.17 ms a round trip, so ticks
        come every ~0.1 s; at 32 streams every 50 ms, as asked).
        Each round trip wakes a tritonserver thread and this one, on the cores the engine's threads compute on:
        asking 32 streams every 50 ms, the large model's saturated run through Triton gave 96.6-97.6 tok/s and
        tritonserver used 1.2-1.3 CPU s; bounded to 0.02, 98.3-103.2 tok/s and 0.7-0.8 s (runs interleaved).
        A cancel waits at most a tick plus a sweep before it is seen."""
        next_tick = time.monotonic() + self._tick
        while not self._stopped.wait(max(next_tick - time.monotonic(), 0.0)):
            start = time.monotonic()
            try:
                self._on_tick()
                self._sweep()
            except Exception:  # a failed tick must not end the watching
                traceback.print_exc()
            end = time.monotonic()
            next_tick = max(next_tick + self._tick, end + (end - start) * self._rest)

    def _sweep(self) -> None:
        open_streams = self._open_senders()
        self._cancelled.intersection_update(req_id for req_id, _ in open_streams)
        for req_id, is_cancelled in open_streams:
            if self._stopped.is_set():
                return
            if req_id not in self._cancelled and is_cancelled():
                self._cancelled.add(req_id)
                self._cancel(req_id)
