"""The in-flight batch manager's threads: one runs engine steps back to back, one delivers their outputs.

Other threads talk to the engine only through a command queue (submit, cancel), applied between steps, so
the engine itself stays single-threaded and a step never sees its blocks freed under it, and through the few
pure calls below (tokenize, validate, describe), which read nothing a step changes. Outputs go to a second
thread, so sending responses never delays the next step; while that thread falls behind, each stream's waiting
outputs are merged into one as they come (outbox.py): one response per stream per turn, however many tokens it
carries. Steps compute on the engine thread only: the thread that builds the loop (the
one that loaded the model) gives its OpenMP pool back (openmp_pool.py), so the engine thread's workers spin
between a step's parallel regions instead of sleeping through each.
"""
from __future__ import annotations

import copy
import queue
import threading
import time
import traceback
from collections.abc import Callable

from . import openmp_pool
from .engine import InflightEngine
from .outputs import RequestOutput
from .outbox import Outbox
from .request import PromptLimits, RequestError, SamplingParams, ServerStopping
from .stats import EngineStats

Emit = Callable[[list[RequestOutput], EngineStats], None]

_IDLE_WAIT_S = 0.05
_EMPTY_STEP_WAIT_S = 0.001  # requests wait but none could be scheduled (static batch filling, pool full)
_STOP_TIMEOUT_S = 10.0  # both threads, in all: well inside Triton's default exit timeout of 30 s


class BatchLoop:
    """Drives `engine` on a background thread; `emit(outputs, stats)` runs on the responder thread. Frees the
    calling thread's OpenMP pool (another region on that thread makes a new one, and slows the steps again)."""

    def __init__(self, engine: InflightEngine, emit: Emit, on_idle: Callable[[], None] | None = None,
                 threads: int = 0) -> None:
        """`threads` > 0: the engine thread's steps compute on that many threads (0: torch's default)."""
        self.engine = engine
        self.threads = threads
        self._emit = emit
        self._on_idle = on_idle or (lambda: None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox()
        self._pending_adds = 0  # submitted, not yet in the engine's waiting queue
        self._pending_lock = threading.Lock()
        self._drain_message: str | None = None  # engine thread only: once set, every request ends with it
        self._closed = False  # set by stop(): emit is never called again
        openmp_pool.give_back()
        self._threads = [threading.Thread(target=self._run_engine, name="inflight-engine", daemon=True),
                         threading.Thread(target=self._run_responder, name="inflight-responder", daemon=True)]
        for thread in self._threads:
            thread.start()

    # Pure calls, safe from any thread (the tokenizer and the engine's configuration, never its state).
    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def encode_chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        return self.engine.encode_chat(messages)

    def encode_word(self, word: str) -> list[int]:
        """A bad or stop word's tokens, without special tokens (as TensorRT-LLM's preprocessing)."""
        return self.engine.tokenizer.encode(word, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def prompt_limits(self) -> PromptLimits:
        return self.engine.prompt_limits()

    def describe(self) -> str:
        engine = self.engine
        threads = f", {self.threads} CPU threads" if self.threads else ""
        return (f"{engine.blocks.num_blocks} KV blocks of {engine.blocks.block_size} tokens{threads}, "
                f"engine: {engine.runner.describe()}")

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None, share_prompt_with: str | None = None) -> None:
        with self._pending_lock:
            self._pending_adds += 1
        self._commands.put(("add", req_id, prompt_ids, params, priority, arrival_time, share_prompt_with))

    def queue_depth(self) -> int:
        """Requests waiting for admission (as of the last step) plus those not yet handed to the engine."""
        return self.engine.stats.num_waiting + self._pending_adds

    def cancel(self, req_id: str) -> None:
        self._commands.put(("cancel", req_id))

    def drain(self, message: str) -> None:
        """End every open request with the error `message`, and every request submitted from now on."""
        self._commands.put(("drain", message))

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> bool:
        """Cancel every open request (each gets its final output), then stop both threads, waiting at most
        `timeout` seconds in all. Once it returns, `emit` is never called again. False if a thread overran."""
        self._commands.put(("stop",))
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._closed = True
        return not any(thread.is_alive() for thread in self._threads)

    def _run_engine(self) -> None:
        engine = self.engine
        if self.threads:
            openmp_pool.use_threads(self.threads)
        idle = True
        while True:
            outputs: list[RequestOutput] = []
            wait = _IDLE_WAIT_S if not engine.has_unfinished() else _EMPTY_STEP_WAIT_S if idle else 0.0
            if not self._apply_commands(outputs, wait):
                break
            idle = True
            if engine.has_unfinished():
                steps_before = engine.stats.num_steps
                try:
                    outputs += engine.step()
                except Exception as exc:  # a failing step must not kill the server: fail its requests
                    outputs += engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                idle = engine.stats.num_steps == steps_before
            if outputs:
                self._outbox.put(outputs, copy.copy(engine.stats))
        self._outbox.close()

    def _apply_commands(self, outputs: list[RequestOutput], wait: float) -> bool:
        """Apply queued commands, waiting up to `wait` seconds for the first; False once asked to stop."""
        while True:
            try:
                command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
            except queue.Empty:
                return True
            wait = 0.0
            kind = command[0]
            if kind == "add":
                self._add(outputs, *command[1:])
            elif kind == "cancel":
                if (out := self.engine.abort(command[1])) is not None:
                    outputs.append(out)
            elif kind == "drain":
                self._drain_message = command[1]
                outputs += self.engine.fail_all(command[1])
            else:
                outputs += [out for req_id in self.engine.open_request_ids()
                            if (out := self.engine.abort(req_id)) is not None]
                self._outbox.put(outputs, copy.copy(self.engine.stats))
                return False

    def _add(self, outputs, req_id, prompt_ids, params, priority, arrival_time, share_prompt_with) -> None:
        with self._pending_lock:
            self._pending_adds -= 1
        try:
            if self._drain_message is not None:
                raise ServerStopping(self._drain_message)
            self.engine.add_request(req_id, prompt_ids, params, priority, arrival_time, share_prompt_with)
        except RequestError as exc:
            outputs.append(RequestOutput(req_id, [], "", "error", len(prompt_ids), 0, error=str(exc)))

    def _run_responder(self) -> None:
        while True:
            taken = self._outbox.take(_IDLE_WAIT_S)
            if taken is None:
                if self._closed:
                    return
                self._on_idle()
                continue
            outputs, stats, end = taken
            if self._closed:
                return
            if outputs and stats is not None:  # (outputs always come with their step's stats)
                try:
                    self._emit(outputs, stats)
                except Exception:  # keep delivering other requests' outputs
                    traceback.print_exc()
            if end:
                return
