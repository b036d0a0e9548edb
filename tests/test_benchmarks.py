"""The benchmark machinery: workloads, arrival processes, the statistics and tables that the figures in
docs/PERFORMANCE.md come from."""
from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
import pytest

from benchmarks.timeline import step_kind_table
from benchmarks.records import RequestRecord, percentile, summarize
from benchmarks.serve_bench import arrival_sets, chunk_budget, ratio_table
from benchmarks.workload import load, make_workload, save


def test_workload_follows_its_distributions():
    items = make_workload(3000, seed=11)
    prompts = [len(i.prompt_ids) for i in items]
    outputs = [i.output_len for i in items]
    assert min(prompts) >= 8 and max(prompts) <= 768
    assert 56 <= statistics.median(prompts) <= 72  # log-normal, median 64
    assert min(outputs) >= 1 and max(outputs) <= 384
    assert sum(o > 96 for o in outputs) > 0  # the 384 cap is drawn for some requests
    assert all(0 <= t < 256 for i in items for t in i.prompt_ids)


def test_long_prompt_workload_has_a_tenth_long_prompts_within_the_context():
    items = make_workload(3000, seed=5, long_prompts=True, max_total=2048)
    long = [i for i in items if len(i.prompt_ids) >= 1024]
    assert 0.08 <= len(long) / len(items) <= 0.12
    assert all(len(i.prompt_ids) + i.output_len <= 2048 for i in items)


def test_workload_is_seeded_and_round_trips_through_jsonl(tmp_path):
    assert make_workload(50, seed=3) == make_workload(50, seed=3)
    assert make_workload(50, seed=3) != make_workload(50, seed=4)
    items = make_workload(20, seed=1, long_prompts=True)
    save(items, tmp_path / "w.jsonl")
    assert load(tmp_path / "w.jsonl") == items


def test_percentile_interpolates_like_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_counts_ttft_from_the_scheduled_arrival():
    records = [RequestRecord(arrival=0.0, prompt_len=4, output_len=3, token_times=[0.5, 0.6, 0.8]),
               RequestRecord(arrival=1.0, prompt_len=4, output_len=2, token_times=[1.1, 2.1])]
    s = summarize(records, {"steps": 7})
    assert s["ttft_p50_s"] == pytest.approx(0.3)  # 0.5 and 0.1
    assert s["itl_p50_s"] == pytest.approx(0.2)  # 0.1, 0.2, 1.0
    assert s["e2e_p99_s"] == pytest.approx(0.8 + 0.99 * (1.1 - 0.8))
    assert s["duration_s"] == pytest.approx(2.1)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 2.1)
    assert s["tpot_p50_s"] == pytest.approx((0.15 + 1.0) / 2)
    assert s["steps"] == 7


def test_summary_refuses_requests_short_of_their_forced_length():
    records = [RequestRecord(arrival=0.0, prompt_len=4, output_len=3, token_times=[0.5, 0.6])]
    with pytest.raises(RuntimeError, match="1 requests"):
        summarize(records)


def test_chunked_target_suffixes():
    assert chunk_budget("chunked", 256) == (256, 0)
    assert chunk_budget("chunked512", 256) == (512, 0)
    assert chunk_budget("chunked512cap128", 256) == (512, 128)
    for bad in ("chunk512", "chunked5x", "chunked512cap", "chunked512capx"):
        with pytest.raises(SystemExit):
            chunk_budget(bad, 256)


def test_poisson_arrivals_have_the_requested_rate_and_saturation_arrives_at_once():
    args = argparse.Namespace(mode="poisson", rates=[4.0, 20.0], seed=2, concurrency=[])
    points = arrival_sets(args, 4000)
    assert [label for label, _, _ in points] == ["rate=4/s", "rate=20/s"]
    for (_, arrivals, concurrency), rate in zip(points, (4.0, 20.0)):
        assert concurrency is None and arrivals == sorted(arrivals)
        assert len(arrivals) / arrivals[-1] == pytest.approx(rate, rel=0.05)
    [(label, arrivals, _)] = arrival_sets(argparse.Namespace(mode="saturation"), 5)
    assert label == "saturation" and arrivals == [0.0] * 5


def test_ratio_table_pairs_targets_within_each_round():
    runs = [{"target": t, "load": load, "round": r, "output_tokens_per_s": v}
            for r, (a, b) in enumerate([(10.0, 5.0), (9.0, 3.0), (8.0, 8.0)])
            for t, load, v in (("x", "saturation", a), ("y", "saturation", b))]
    table = ratio_table(runs, [("x", "y")])
    assert "| saturation | x / y | 2.00 3.00 1.00 | 2.00 |" in table.splitlines()


def test_step_kind_table_splits_time_by_kind_of_step():
    # (time at the step's end, prompt tokens, decode tokens, running, waiting); the first entry only starts the clock
    run = {"timeline": [(0.0, 0, 0, 0, 0), (0.1, 100, 0, 1, 0), (0.12, 0, 1, 1, 0), (0.32, 200, 1, 2, 0),
                        (0.34, 0, 2, 2, 0)]}
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in step_kind_table(run).splitlines()[2:]}
    assert rows["prompt only"][:3] == ["0.10", "1", "100"]
    assert rows["decode only"][:4] == ["0.04", "2", "0", "3"]
    assert rows["mixed"][0] == "0.20" and rows["mixed"][-1].strip(" |") == "1000.0"  # 0.2 s / 200 prompt tokens
