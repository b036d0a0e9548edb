"""Several outputs of one request, merged into one: how a stream that fell behind catches up in one response.

The engine emits one RequestOutput per request per step. When the responder has several steps' outputs waiting
(sending fell behind the engine), each stream's consecutive outputs are merged, so it gets one response with all
its new tokens instead of one response (one round trip to tritonserver) per token. When the responder keeps up,
nothing waits and every token still leaves at once. Outputs that carry something per token (log-probabilities,
logits) or an error are not merged: they keep their own response, in order. A stream that asked for
`stream_interval` N holds its outputs (model.py) until N tokens are merged or it ends.
"""
from __future__ import annotations

from dataclasses import replace

from .engine import RequestOutput


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
    merged: list[RequestOutput | list[RequestOutput]] = []  # a list: a run of one request's outputs, merged below
    open_at: dict[str, int] = {}  # req_id -> index in merged of its run still open to merging
    for out in outputs:
        at = open_at.get(out.req_id)
        if at is not None and mergeable(out):
            run = merged[at]
            if isinstance(run, list):
                run.append(out)
            else:
                merged[at] = [run, out]
        else:
            open_at.pop(out.req_id, None)
            if mergeable(out):
                open_at[out.req_id] = len(merged)
            merged.append(out)
        if out.finished:
            open_at.pop(out.req_id, None)
    return [_join(item) if isinstance(item, list) else item for item in merged]


def _join(run: list[RequestOutput]) -> RequestOutput:
    """merge() over a run, building the token list and the text once."""
    first, last = run[0], run[-1]
    context = next((o.context_logits for o in run if o.context_logits is not None), None)
    return replace(last, token_ids=[t for o in run for t in o.token_ids], text="".join(o.text for o in run),
                   token_time=first.token_time, context_logits=context)
