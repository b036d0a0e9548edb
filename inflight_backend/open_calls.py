"""The calls whose FINAL response has not gone yet, and their sequences by engine request id.

Three threads share them: Triton's (`execute()` opens calls), the responder (it finishes sequences and closes
each call before its FINAL) and the cancel watcher (it asks each open call's sender whether its client has gone).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from .calls import Call, Sequence


class OpenCalls:
    """Calls by key and sequences by request id. A call is closed (`Call.closed`) under the same lock as every
    `is_cancelled()` on its sender, so no ask overlaps its FINAL: python_backend 2.51 frees a request's response
    factory once its FINAL is sent, and is_cancelled() on it afterwards crashes tritonserver (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled)."""

    def __init__(self) -> None:
        self._calls: dict[str, Call] = {}
        self._sequences: dict[str, Sequence] = {}  # written by Triton's thread, then by the responder only
        self._lock = threading.Lock()
        self._final_lock = threading.Lock()  # between a call's closing and an is_cancelled() on its sender
        # Responder, once per output: the sequence it belongs to, None once finished (the dict's own get: no
        # Python frame per token)
        self.sequence: Callable[[str], Sequence | None] = self._sequences.get

    def open(self, call: Call, sequences: dict[str, Sequence]) -> None:
        """Triton's thread, before any of `sequences` is submitted."""
        call.open.update(sequences)
        self._sequences.update(sequences)
        with self._lock:
            self._calls[call.key] = call

    def finish(self, req_id: str, seq: Sequence) -> bool:
        """Responder: `seq` has had its last output. True when that ends its call, which is then closed: its
        sender is never asked again, and the response about to go must carry FINAL."""
        del self._sequences[req_id]
        call = seq.call
        call.open.discard(req_id)
        if call.open:
            return False
        with self._lock:
            del self._calls[call.key]
        with self._final_lock:
            call.closed = True
        return True

    def __len__(self) -> int:
        return len(self._calls)

    def senders(self) -> list[tuple[str, Callable[[], bool]]]:
        """Watcher: (call key, is_cancelled) for every open call."""
        with self._lock:
            return [(key, partial(self._asks_cancelled, call)) for key, call in self._calls.items()]

    def open_ids(self, key: str) -> list[str]:
        """Watcher: the sequences of call `key` still running ([] once it has closed)."""
        with self._lock:
            call = self._calls.get(key)
            return list(call.open) if call is not None else []

    def _asks_cancelled(self, call: Call) -> bool:
        with self._final_lock:
            return not call.closed and call.sender.is_cancelled()
