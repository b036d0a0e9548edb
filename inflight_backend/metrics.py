"""Triton custom metrics (on the server's metrics port) fed from the engine's stats snapshots."""
from __future__ import annotations

from .engine import EngineStats

# metric name: (kind, description, EngineStats field)
COUNTERS = {
    "inflight_steps_total": ("engine iterations run", "num_steps"),
    "inflight_prompt_tokens_total": ("prompt tokens computed", "num_prompt_tokens"),
    "inflight_generated_tokens_total": ("tokens generated", "num_generated_tokens"),
    "inflight_requests_finished_total": ("requests ended (any reason)", "num_finished"),
}
GAUGES = {
    "inflight_requests_running": ("requests in the running batch", "num_running"),
    "inflight_requests_waiting": ("requests queued for admission", "num_waiting"),
    "inflight_kv_blocks_used": ("KV cache blocks owned by sequences", "kv_blocks_used"),
    "inflight_kv_blocks_total": ("KV cache blocks in the pool", "kv_blocks_total"),
    "inflight_step_batch_size": ("sequences in the last iteration", "last_step_num_seqs"),
}


class TritonMetrics:
    """One labelled metric per stats field. `pb_utils` is passed in because it exists only inside Triton."""

    def __init__(self, pb_utils, model_name: str) -> None:
        family = pb_utils.MetricFamily
        labels = {"model": model_name}
        # Families must outlive their metrics, so both are kept.
        self._families = {name: family(name=name, description=desc, kind=family.COUNTER)
                          for name, (desc, _) in COUNTERS.items()}
        self._families.update({name: family(name=name, description=desc, kind=family.GAUGE)
                               for name, (desc, _) in GAUGES.items()})
        self._counters = {field: self._families[name].Metric(labels=labels) for name, (_, field) in COUNTERS.items()}
        self._gauges = {field: self._families[name].Metric(labels=labels) for name, (_, field) in GAUGES.items()}
        self._last = EngineStats()

    def update(self, stats: EngineStats) -> None:
        for field, metric in self._counters.items():
            delta = getattr(stats, field) - getattr(self._last, field)
            if delta:
                metric.increment(delta)
        for field, metric in self._gauges.items():
            metric.set(getattr(stats, field))
        self._last = stats
