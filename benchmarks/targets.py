"""Systems under test, all driven by the same workload and arrival times and recording per-token times.

- EngineTarget: our engine in-process (the batch loop's threads, no server), any batching policy.
- TritonTarget (benchmarks/triton_target.py): our backend through a real tritonserver.
- HFStaticTarget: Hugging Face `generate` on static left-padded batches (request-level batching).
- HFContinuousTarget: Hugging Face's own continuous batching (`generate_batch`'s manager).

`run(items, arrivals, concurrency)` submits item i at `arrivals[i]` seconds after the start (open loop), or,
with `concurrency`, whenever fewer than that many are in flight (closed loop); it returns the records and a
dict of extra metrics.
"""
from __future__ import annotations

import copy
import threading
import time

import torch

from benchmarks.records import RequestRecord
from benchmarks.workload import WorkItem
from inflight_backend import gc_tuning
from inflight_backend.batch_loop import BatchLoop
from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams


class Submitter:
    """Open-loop (scheduled arrivals) or closed-loop (fixed concurrency) submission from the calling thread."""

    def __init__(self, records: list[RequestRecord], concurrency: int | None) -> None:
        self.records = records
        self.slots = threading.Semaphore(concurrency) if concurrency else None
        self.remaining = len(records)
        self.all_done = threading.Event()
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, submit) -> None:
        self.t0 = time.perf_counter()
        for i, record in enumerate(self.records):
            if self.slots is not None:
                self.slots.acquire()
                record.arrival = self.now()
            else:
                delay = record.arrival - self.now()
                if delay > 0:
                    time.sleep(delay)
            submit(i)
        self.all_done.wait()

    def token(self, i: int, when: float | None = None) -> None:
        self.records[i].token_times.append(self.now() if when is None else when)

    def finished(self) -> None:
        if self.slots is not None:
            self.slots.release()
        self.remaining -= 1  # only the single delivering thread calls this
        if self.remaining == 0:
            self.all_done.set()


def new_records(items: list[WorkItem], arrivals: list[float]) -> list[RequestRecord]:
    return [RequestRecord(a, len(it.prompt_ids), it.output_len) for it, a in zip(items, arrivals)]


class EngineTarget:
    def __init__(self, checkpoint: str, sampling: tuple[float, float] = (0.0, 1.0), **params) -> None:
        """`sampling`: the timed requests' (temperature, top_p); (0, 1): greedy."""
        self.engine = InflightEngine(EngineConfig(checkpoint=checkpoint, **params))
        self.sampling = sampling
        gc_tuning.for_serving()  # as the Triton model does: both sides of goal 5 run with the same collector
        self.timeline: list[tuple] = []

    def run(self, items, arrivals, concurrency=None):
        records = new_records(items, arrivals)
        sub = Submitter(records, concurrency)
        self.timeline = []
        before = copy.copy(self.engine.stats)

        def emit(outputs, stats):
            now = sub.now()
            for out in outputs:  # a coalesced output (the emitter fell behind) carries several tokens, all here now
                for _ in out.token_ids:
                    sub.token(int(out.req_id), now)
                if out.finished:
                    sub.finished()
            self.timeline.append((sub.now(), stats.last_step_prefill_tokens, stats.last_step_decode_tokens,
                                  stats.num_running, stats.num_waiting))

        loop = BatchLoop(self.engine, emit)
        cpu_before = time.process_time()
        try:
            sub.run(lambda i: loop.submit(str(i), items[i].prompt_ids, _forced(items[i].output_len, self.sampling)))
        finally:
            loop.stop()
        cpu = {"process": time.process_time() - cpu_before}
        return records, {**_engine_extra(self.engine, before), "cpu_seconds": cpu}

    def greedy_ids(self, prompt_ids: list[int], n: int) -> list[int]:
        """At most `n` greedy tokens for one prompt, the engine alone (call between runs)."""
        self.engine.add_request("greedy-check", list(prompt_ids), SamplingParams(max_tokens=n))
        ids: list[int] = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                ids.extend(out.token_ids)
        return ids


def _forced(n: int, sampling: tuple[float, float] = (0.0, 1.0)) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=sampling[0], top_p=sampling[1])


def _engine_extra(engine, before) -> dict:
    s = engine.stats
    schedule = s.schedule_seconds - before.schedule_seconds
    model = s.model_seconds - before.model_seconds
    sample = s.sample_seconds - before.sample_seconds
    steps = s.num_steps - before.num_steps
    pool_tokens = engine.blocks.num_blocks * engine.blocks.block_size
    return {"steps": steps, "overhead_fraction": (schedule + sample) / max(schedule + model + sample, 1e-9),
            "kv_token_utilisation": (s.kv_tokens_used_sum - before.kv_tokens_used_sum) / max(steps * pool_tokens, 1),
            "preemptions": s.num_preemptions - before.num_preemptions,
            "cached_prompt_tokens": s.num_cached_tokens - before.num_cached_tokens,
            "computed_prompt_tokens": s.num_prompt_tokens - before.num_prompt_tokens}


class HFStaticTarget:
    """Request-level batching: up to `max_batch_size` arrived requests run to completion together."""

    def __init__(self, checkpoint: str, max_batch_size: int, dtype: str = "float32") -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        self.max_batch_size = max_batch_size

    @torch.inference_mode()
    def run(self, items, arrivals, concurrency=None):
        from transformers import StoppingCriteria, StoppingCriteriaList

        records = new_records(items, arrivals)
        t0 = time.perf_counter()
        step_times: list[float] = []

        class Recorder(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                step_times.append(time.perf_counter() - t0)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        next_i = 0
        while next_i < len(items):
            now = time.perf_counter() - t0
            if records[next_i].arrival > now:
                time.sleep(records[next_i].arrival - now)
                now = time.perf_counter() - t0
            batch = [i for i in range(next_i, min(next_i + self.max_batch_size, len(items)))
                     if records[i].arrival <= now]
            step_times.clear()
            self._generate([items[i] for i in batch], StoppingCriteriaList([Recorder()]))
            for i in batch:
                records[i].token_times = step_times[: items[i].output_len]
            next_i = batch[-1] + 1
        return records, {}

    def _generate(self, batch: list[WorkItem], stopping) -> None:
        width = max(len(it.prompt_ids) for it in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, it in enumerate(batch):  # left padding
            ids[row, width - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
            mask[row, width - len(it.prompt_ids):] = 1
        n = max(it.output_len for it in batch)
        self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0, stopping_criteria=stopping)


class HFContinuousTarget:
    """Hugging Face transformers' own continuous batching with paged attention (what `generate_batch` runs)."""

    def __init__(self, checkpoint: str, max_batch_size: int, dtype: str = "float32") -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        self.max_batch_size = max_batch_size

    def run(self, items, arrivals, concurrency=None):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        records = new_records(items, arrivals)
        config = GenerationConfig(max_new_tokens=max(it.output_len for it in items), do_sample=False)
        manager = self.model.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=self.max_batch_size))
        manager.start()
        t0 = time.perf_counter()
        try:
            for i, it in enumerate(items):
                delay = records[i].arrival - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
                manager.add_request(it.prompt_ids, request_id=str(i), max_new_tokens=it.output_len,
                                    record_timestamps=True, eos_token_id=-1)
            pending = len(items)
            while pending:
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError("transformers' continuous batching stopped without finishing")
                if out.is_finished():
                    i = int(out.request_id)
                    records[i].token_times = [t - t0 for t in (out.timestamps or [])][: items[i].output_len]
                    pending -= 1
        finally:
            manager.stop(block=True)
        return records, {}


def check_greedy(target, checkpoint: str, cases: list[tuple[list[int], int]],
                 dtype: str = "float32") -> list[tuple[int, int, float]]:
    """For each case: the tokens from the start that the target's greedy ids share with transformers' generate in
    `dtype`, the tokens transformers generated (at most the case's n; a case stops at the model's end token like
    generate does), and the target's worst choice: over its tokens, transformers' logits teacher-forced on the
    target's own ids, the largest gap between a position's best logit and the chosen one's, in units of bf16's
    spacing at that best logit (2^-7 of its power of two; 0 where every choice is transformers' argmax)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    eos = model.generation_config.eos_token_id
    agree = []
    for ids, n in cases:
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        if eos in want:
            want = want[:want.index(eos) + 1]
        got = target.greedy_ids(ids, n)[:len(want)]
        common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1: len(ids) - 1 + len(got)].float()
        best = logits.max(dim=-1).values
        gaps = (best - logits[torch.arange(len(got)), torch.tensor(got, dtype=torch.long)])
        spacing = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)
        agree.append((common, len(want), float((gaps / spacing).max()) if got else 0.0))
    return agree
