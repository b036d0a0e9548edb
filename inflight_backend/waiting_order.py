"""Which waiting request is admitted next: preempted ones first, then the highest priority (aged, so nobody
starves), then arrival order; optionally the longest cached prefix first among equals (SGLang's), bounded."""
from __future__ import annotations

from .block_manager import BlockManager
from .request import Request, RequestStatus

CACHE_AWARE_WINDOW = 64


def next_waiting(waiting: list[Request], now: float, aging_s: float, cache_aware_wait_s: float,
                 blocks: BlockManager) -> Request | None:
    """The request to admit next of `waiting`, or None while each waits for its prompt's source. A request that
    will share its prompt's blocks waits until their source has computed them. `aging_s`: a request gains one
    priority level per this many seconds waited; `cache_aware_wait_s` > 0: cached prefixes first (below)."""
    ready = [r for r in waiting if not awaits_source(r)]
    if not ready:
        return None
    if cache_aware_wait_s > 0 and blocks.enable_reuse:
        return cache_aware_next(ready, now, aging_s, cache_aware_wait_s, blocks)

    def key(r: Request):
        return (r.num_preemptions == 0, -(r.priority + (now - r.arrival_time) / aging_s), r.arrival_time)

    return min(ready, key=key)


def cache_aware_next(ready: list[Request], now: float, aging_s: float, bound_s: float,
                     blocks: BlockManager) -> Request:
    """Within a priority level, a request whose prompt has more blocks in the cache goes first, unless another
    has waited `bound_s` (then arrival order). Only the oldest CACHE_AWARE_WINDOW waiting requests are looked up,
    so a long queue costs no more than that."""
    size = blocks.block_size
    window = sorted(ready, key=lambda r: r.arrival_time)[:CACHE_AWARE_WINDOW]

    def key(r: Request):
        age = now - r.arrival_time
        starving = age >= bound_s
        cached = 0 if starving else len(blocks.lookup(r.token_ids(0, r.num_tokens), (r.num_tokens - 1) // size))
        return (r.num_preemptions == 0, -int(r.priority + age / aging_s), not starving, -cached, r.arrival_time)

    return min(window, key=key)


def awaits_source(request: Request) -> bool:
    """Its prompt's source is admitted (or about to be) but has not computed the prompt yet: sharing is worth
    the wait (the source's next step computes it). A finished or preempted source is not waited for."""
    source = request.prefix_source
    if source is None or source.status.is_finished or request.num_preemptions:
        return False
    return source.status == RequestStatus.WAITING and not source.num_preemptions or \
        (source.status == RequestStatus.RUNNING and source.num_computed_tokens < request.num_prompt_tokens - 1)
