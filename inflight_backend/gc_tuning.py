"""The cyclic garbage collector's settings for a serving process.

Each engine step allocates a few objects per token (its outputs, lists, small tensors' wrappers) and frees almost
all of them by reference counting; yet CPython's collector counts them and runs a young-generation pass every 700
net allocations, and every so often a full pass over every object the process holds (torch's, the tokenizer's,
the model's: hundreds of thousands). At hundreds of streams that is dozens of passes a second, on the thread that
runs the engine. `for_serving()`, once the model is loaded: what exists then lives as long as the process, so it is
moved out of the collector's sight (gc.freeze), and the young generation is collected every YOUNG_THRESHOLD
allocations instead of 700 (cycles still get collected, later).
"""
from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def for_serving() -> None:
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
