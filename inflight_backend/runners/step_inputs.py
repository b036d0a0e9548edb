"""One step's packed inputs, built from a SchedulerOutput: the single place that turns a schedule into token ids,
positions, slots and per-sequence offsets (every runner uses it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..scheduler_output import ScheduledRequest, SchedulerOutput


def context_rows(item: ScheduledRequest) -> range:
    """Positions of the prompt whose logits this step also returns for a request that asked for its context
    logits: those it computes now and has not returned yet (a recompute after preemption returns none)."""
    req = item.request
    if not req.params.return_context_logits:
        return range(0)
    start = req.num_computed_tokens
    return range(max(start, req.num_context_logits), min(start + item.num_tokens, req.num_prompt_tokens))


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # flat KV slot of each new token
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # sequence i owns rows [qsl[i], qsl[i+1])
    context_lens: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # rows whose logits are sampled, then context rows
    block_tables: list[list[int]] = field(default_factory=list)  # padded with 0 to the widest

    @classmethod
    def build(cls, output: SchedulerOutput, block_size: int) -> StepInputs:
        step = cls()
        for item in output.scheduled:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            table = item.block_table
            step.input_ids += req.token_ids(start, end)
            step.positions += range(start, end)
            step.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            step.query_start_loc.append(step.query_start_loc[-1] + item.num_tokens)
            step.context_lens.append(end)
            if item.sample:
                step.sample_indices.append(step.query_start_loc[-1] - 1)
        for i, item in enumerate(output.scheduled):  # after every sampled row: the engine splits them there
            start = item.request.num_computed_tokens
            step.sample_indices += [step.query_start_loc[i] + p - start for p in context_rows(item)]
        width = max(len(item.block_table) for item in output.scheduled)
        step.block_tables = [item.block_table + [0] * (width - len(item.block_table)) for item in output.scheduled]
        return step

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == len(self.context_lens)

    def engine_inputs(self) -> dict[str, tuple[list, torch.dtype]]:
        """The exported graph's inputs (all but the KV pool) with their dtypes."""
        i32 = torch.int32
        return {"input_ids": (self.input_ids, i32), "positions": (self.positions, i32),
                "block_tables": (self.block_tables, i32), "context_lens": (self.context_lens, i32),
                "query_start_loc": (self.query_start_loc, i32), "slot_mapping": (self.slot_mapping, torch.int64),
                "sample_indices": (self.sample_indices, i32)}
