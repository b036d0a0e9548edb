"""Several outputs of one request, merged into one: how a stream that fell behind catches up in one response.

The engine emits one RequestOutput per request per step. When the responder has several steps' outputs waiting
(sending fell behind the engine), each stream's consecutive outputs are merged, so it gets one response with all
its new tokens instead of one response (one round trip to tritonserver) per token. When the responder keeps up,
nothing waits and every token still leaves at once. Outputs that carry something per token (log-probabilities,
logits) or an error are not merged: they keep their own response, in order. A stream that asked for
`stream_interval` N holds its outputs (responder.py) until N tokens are merged or it ends.
"""
from __future__ import annotations

from dataclasses import replace

from .outputs import RequestOutput


def mergeable(out: RequestOutput) -> bool:
    """Whether `out` can be joined to its request's earlier or later outputs in one response."""
    return out.token_info is None and out.error is None


def merge(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output saying what `first` then `later` (the same request's next output) say. `first` is not
    changed. The first token's time stays (it is the one a time-to-first-token measures), and the prompt's
    logits, which come with the first token."""
    context = first.context_logits if first.context_logits is not None else later.context_logits
    return replace(later, token_ids=first.token_ids + later.token_ids, text=first.text + later.text,
                   token_time=first.token_time, context_logits=context)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """`outputs` in order, each request's run of consecutive mergeable outputs merged into its first place."""
    runs = Coalescer()
    runs.add(outputs)
    return runs.take()


class Coalescer:
    """coalesce() as outputs arrive: each request's open run is joined as each output comes, so however far the
    engine runs ahead of the responder, what waits is one output per stream (the engine's per-token outputs are
    freed at once, and the garbage collector's passes do not walk a backlog of them)."""

    def __init__(self) -> None:
        self._items: list[RequestOutput | _Run] = []
        self._open: dict[str, _Run] = {}  # req_id -> its run still open to merging

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, outputs: list[RequestOutput]) -> None:
        items, open_runs = self._items, self._open
        for out in outputs:
            run = open_runs.get(out.req_id)
            if run is not None and out.token_info is None and out.error is None:  # mergeable(out)
                run.add(out)
            elif mergeable(out):
                run = open_runs[out.req_id] = _Run(out)
                items.append(run)
            else:
                open_runs.pop(out.req_id, None)
                items.append(out)
            if out.finish_reason is not None:
                open_runs.pop(out.req_id, None)

    def take(self) -> list[RequestOutput]:
        """Everything added since the last take, merged, in order; the coalescer is empty after."""
        items, self._items, self._open = self._items, [], {}
        return [item.output() if isinstance(item, _Run) else item for item in items]


class _Run:
    """One request's consecutive mergeable outputs: the first's time and prompt logits, the last's other fields,
    the token ids and text of all."""

    __slots__ = ("first", "last", "token_ids", "texts")

    def __init__(self, out: RequestOutput) -> None:
        self.first = self.last = out
        self.token_ids: list[int] | None = None  # until a second output comes
        self.texts: list[str] = []

    def add(self, out: RequestOutput) -> None:
        if self.token_ids is None:
            self.token_ids, self.texts = list(self.first.token_ids), [self.first.text]
        self.token_ids += out.token_ids
        self.texts.append(out.text)
        if self.first.context_logits is None and out.context_logits is not None:
            self.first = replace(self.first, context_logits=out.context_logits)
        self.last = out

    def output(self) -> RequestOutput:
        if self.token_ids is None:
            return self.first
        return replace(self.last, token_ids=self.token_ids, text="".join(self.texts),
                       token_time=self.first.token_time, context_logits=self.first.context_logits)
