"""TensorRT-LLM's batched request layout (a model with Triton `max_batch_size` > 0): every input carries a
leading batch dimension (`text_input` [B, 1], `input_ids` [B, L] with `input_lengths` [B, 1], scalars [B, 1]).

A request of B rows is served as B independent sequences; `split_rows` gives one getter per row that returns
that row's arrays, so each row is parsed exactly as an unbatched request (`protocol.parse_request`).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .request import RequestError

Getter = Callable[[str], "np.ndarray | None"]


def split_rows(get: Getter) -> list[Getter]:
    """One getter per row of a batched request; the row count is the prompt's first dimension."""
    cache: dict[str, np.ndarray | None] = {}

    def batched(name: str) -> np.ndarray | None:
        if name not in cache:
            cache[name] = get(name)
        return cache[name]

    prompt = batched("text_input")
    if prompt is None:
        prompt = batched("input_ids")
    rows = 1 if prompt is None or prompt.ndim == 0 else prompt.shape[0]
    if rows == 0:
        raise RequestError("the request has no rows (its batch dimension is 0)")

    def row_getter(i: int) -> Getter:
        def get_row(name: str) -> np.ndarray | None:
            array = batched(name)
            if array is None:
                return None
            if array.ndim == 0 or array.shape[0] != rows:
                raise RequestError(f"input {name!r} has shape {list(array.shape)}: with a batch dimension of "
                                   f"{rows} (the prompt's), it needs {rows} rows")
            return array[i]
        return get_row

    return [row_getter(i) for i in range(rows)]
