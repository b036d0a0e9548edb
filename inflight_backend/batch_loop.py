"""The in-flight batch manager's threads: one runs engine steps back to back, one delivers their outputs.

Other threads talk to the engine only through a command queue (submit, cancel), applied between steps, so
the engine itself stays single-threaded and a step never sees its blocks freed under it. Outputs go to a
second thread, so sending responses never delays the next step.
"""
from __future__ import annotations

import copy
import queue
import threading
import traceback
from typing import Callable

from .engine import EngineStats, InflightEngine, RequestError, RequestOutput
from .request import SamplingParams

Emit = Callable[[list[RequestOutput], EngineStats], None]

_IDLE_WAIT_S = 0.05


class BatchLoop:
    """Drives `engine` on a background thread; `emit(outputs, stats)` runs on the responder thread."""

    def __init__(self, engine: InflightEngine, emit: Emit, on_idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._emit = emit
        self._on_idle = on_idle or (lambda: None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run_engine, name="inflight-engine", daemon=True),
                         threading.Thread(target=self._run_responder, name="inflight-responder", daemon=True)]
        for thread in self._threads:
            thread.start()

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._commands.put(("add", req_id, prompt_ids, params))

    def cancel(self, req_id: str) -> None:
        self._commands.put(("cancel", req_id))

    def stop(self) -> None:
        """Cancel every open request (each gets its final output), then stop both threads."""
        self._commands.put(("stop",))
        for thread in self._threads:
            thread.join(timeout=30)

    def _run_engine(self) -> None:
        engine = self.engine
        while True:
            outputs: list[RequestOutput] = []
            if not self._apply_commands(outputs, block=not engine.has_unfinished()):
                break
            if engine.has_unfinished():
                try:
                    outputs += engine.step()
                except Exception as exc:  # a failing step must not kill the server: fail its requests
                    outputs += engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            if outputs:
                self._outputs.put((outputs, copy.copy(engine.stats)))
        self._outputs.put(None)

    def _apply_commands(self, outputs: list[RequestOutput], block: bool) -> bool:
        """Apply queued commands; False once asked to stop (after cancelling everything)."""
        while True:
            try:
                command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "add":
                self._add(outputs, *command[1:])
            elif kind == "cancel":
                if (out := self.engine.abort(command[1])) is not None:
                    outputs.append(out)
            else:
                outputs += [self.engine.abort(req_id) for req_id in self.engine.open_request_ids()]
                self._outputs.put((outputs, copy.copy(self.engine.stats)))
                return False

    def _add(self, outputs, req_id, prompt_ids, params) -> None:
        try:
            self.engine.add_request(req_id, prompt_ids, params)
        except RequestError as exc:
            outputs.append(RequestOutput(req_id, [], "", "error", len(prompt_ids), 0, error=str(exc)))

    def _run_responder(self) -> None:
        while True:
            try:
                item = self._outputs.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                self._on_idle()
                continue
            if item is None:
                return
            try:
                self._emit(*item)
            except Exception:  # keep delivering other requests' outputs
                traceback.print_exc()
