"""Triton custom metrics (on the server's metrics port), fed from engine stats snapshots and request outputs."""
from __future__ import annotations

from .request import REJECTION_REASONS
from .stats import EngineStats

# Counters mirrored from EngineStats fields: name -> (description, field)
COUNTERS = {
    "inflight_steps_total": ("engine iterations run", "num_steps"),
    "inflight_prompt_tokens_total": ("prompt tokens computed (recomputation after preemption included)",
                                     "num_prompt_tokens"),
    "inflight_generated_tokens_total": ("tokens generated", "num_generated_tokens"),
    "inflight_preemptions_total": ("running requests preempted for KV blocks (max_utilization)", "num_preemptions"),
    "inflight_prefix_cache_tokens_total": ("prompt tokens served from computed blocks (prefix cache, sibling "
                                           "sequences) instead of computed", "num_cached_tokens"),
    "inflight_prefix_cache_blocks_reused_total": ("KV blocks taken as computed at admission", "num_reused_blocks"),
    "inflight_prefix_cache_evictions_total": ("cached KV blocks whose content was dropped to make room",
                                              "num_evicted_blocks"),
}
GAUGES = {
    "inflight_kv_blocks_used": ("KV cache blocks held by sequences", "kv_blocks_used"),
    "inflight_kv_blocks_cached": ("KV cache blocks nobody holds whose content is kept for reuse (counted as free)",
                                  "kv_blocks_cached"),
    "inflight_kv_blocks_total": ("KV cache blocks in the pool", "kv_blocks_total"),
    "inflight_step_batch_size": ("sequences in the last iteration", "last_step_num_seqs"),
    "inflight_step_prefill_tokens": ("prompt tokens in the last iteration", "last_step_prefill_tokens"),
    "inflight_step_decode_tokens": ("decode tokens in the last iteration", "last_step_decode_tokens"),
    "inflight_step_token_budget": ("token budget of the last iteration (max_num_tokens, or as step_time_target_ms "
                                   "sized it)", "last_step_token_budget"),
}
REQUEST_STATES = {"running": "num_running", "waiting": "num_waiting", "preempted": "num_preempted_waiting"}
PHASES = {"schedule": "schedule_seconds", "model": "model_seconds", "sample": "sample_seconds"}
FINISH_REASONS = ("stop", "length", "cancelled", "error")
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class TritonMetrics:
    """`pb_utils` is passed in because it exists only inside Triton. Not thread-safe: call from the responder."""

    def __init__(self, pb_utils, model_name: str) -> None:
        family_type = pb_utils.MetricFamily
        self._families: list = []  # families must outlive their metrics
        labels = {"model": model_name}

        def family(name, description, kind):
            self._families.append(family_type(name=name, description=description, kind=kind))
            return self._families[-1]

        counter, gauge, histogram = family_type.COUNTER, family_type.GAUGE, family_type.HISTOGRAM
        self._counters = {field: family(name, desc, counter).Metric(labels=labels)
                          for name, (desc, field) in COUNTERS.items()}
        self._gauges = {field: family(name, desc, gauge).Metric(labels=labels)
                        for name, (desc, field) in GAUGES.items()}
        self._kv_free = family("inflight_kv_blocks_free", "KV cache blocks free", gauge).Metric(labels=labels)
        requests = family("inflight_requests", "requests by state", gauge)
        self._states = {field: requests.Metric(labels={**labels, "state": state})
                        for state, field in REQUEST_STATES.items()}
        finished = family("inflight_requests_finished_total", "requests ended, by finish reason", counter)
        self._finished = {reason: finished.Metric(labels={**labels, "reason": reason}) for reason in FINISH_REASONS}
        rejected = family("inflight_requests_rejected_total",
                          "requests refused before they started, by reason (each also got an error response)", counter)
        self._rejected = {reason: rejected.Metric(labels={**labels, "reason": reason}) for reason in REJECTION_REASONS}
        phases = family("inflight_step_seconds_total", "time in each phase of the iterations", counter)
        self._phases = {phase: phases.Metric(labels={**labels, "phase": phase}) for phase in (*PHASES, "respond")}
        self._ttft, self._tpot, self._e2e = (
            family(name, desc, histogram).Metric(labels=labels, buckets=LATENCY_BUCKETS) for name, desc in (
                ("inflight_time_to_first_token_seconds", "arrival to first token"),
                ("inflight_time_per_output_token_seconds",
                 "per request: (last token - first token) / (output tokens - 1)"),
                ("inflight_e2e_request_latency_seconds", "arrival to final response")))
        self._last = EngineStats()

    def update(self, stats: EngineStats, respond_seconds: float) -> None:
        for field, metric in self._counters.items():
            if delta := getattr(stats, field) - getattr(self._last, field):
                metric.increment(delta)
        for phase, field in PHASES.items():
            if delta := getattr(stats, field) - getattr(self._last, field):
                self._phases[phase].increment(delta)
        self._phases["respond"].increment(respond_seconds)
        for field, metric in {**self._gauges, **self._states}.items():
            metric.set(getattr(stats, field))
        self._kv_free.set(stats.kv_blocks_total - stats.kv_blocks_used)
        self._last = stats

    def record_rejections(self, counts: dict[str, int]) -> None:
        for reason, count in counts.items():
            self._rejected[reason].increment(count)

    def observe_first_token(self, seconds_since_arrival: float) -> None:
        self._ttft.observe(seconds_since_arrival)

    def record_finished(self, counts: dict[str, int]) -> None:
        """Requests ended since the last call, by finish reason: one increment per reason, not per request."""
        for reason, count in counts.items():
            self._finished[reason].increment(count)

    def observe_finished(self, e2e_seconds: float, time_per_output_token: float | None) -> None:
        """One request ended; time_per_output_token is None when it produced fewer than two tokens.
        (Per-token observations would cost one IPC round trip to tritonserver per token.)"""
        self._e2e.observe(e2e_seconds)
        if time_per_output_token is not None:
            self._tpot.observe(time_per_output_token)
