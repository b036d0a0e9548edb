"""What a benchmark run records per request, and the summary statistics computed from it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Times in seconds from the run's start (time.perf_counter based). `arrival` is the scheduled arrival."""

    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], extra: dict | None = None) -> dict:
    """Throughput and latency of one run. Every request must have produced its tokens."""
    incomplete = [r for r in records if len(r.token_times) != r.output_len]
    if incomplete:
        raise RuntimeError(f"{len(incomplete)} requests did not produce their forced number of tokens")
    start = min(r.arrival for r in records)
    duration = max(r.token_times[-1] for r in records) - start
    tokens = sum(r.output_len for r in records)
    ttfts, e2es = [r.ttft for r in records], [r.e2e for r in records]
    itls = [x for r in records for x in r.itls]
    tpots = [(r.token_times[-1] - r.token_times[0]) / (r.output_len - 1) for r in records if r.output_len > 1]
    summary = {
        "num_requests": len(records), "duration_s": duration, "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration, "requests_per_s": len(records) / duration,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "e2e_p50_s": percentile(e2es, 50), "e2e_p99_s": percentile(e2es, 99),
        "tpot_p50_s": percentile(tpots, 50),
    }
    summary.update(extra or {})
    return summary
