"""Outputs on their way from the engine thread to the responder thread, merged per stream while they wait.

The engine thread never waits for the responder: when sending falls behind, steps' outputs pile up here. They are
merged as they come (coalesce.Coalescer), so the backlog is one output per stream, not one per token: at the null
model's 1,024 streams a per-token backlog held 260,000 outputs, and the collector's passes over it took ~1 s of
the stub's ~10 s (gc.callbacks timings).
"""
from __future__ import annotations

import threading

from .coalesce import Coalescer
from .outputs import RequestOutput
from .stats import EngineStats


class Outbox:
    """put() after each step on the engine thread, close() after the last; take() on the responder thread."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._waiting = Coalescer()
        self._stats: EngineStats | None = None
        self._closed = False

    def put(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        with self._ready:
            self._waiting.add(outputs)
            self._stats = stats
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()

    def take(self, timeout: float) -> tuple[list[RequestOutput], EngineStats | None, bool] | None:
        """Everything put since the last take, each stream's consecutive outputs merged, with the latest stats,
        and whether the outbox is closed (nothing more will come); None if nothing came within `timeout` s."""
        with self._ready:
            if not self._waiting and not self._closed:
                self._ready.wait(timeout)
            if not self._waiting and not self._closed:
                return None
            waiting, self._waiting = self._waiting, Coalescer()
            stats, closed = self._stats, self._closed
        return waiting.take(), stats, closed
