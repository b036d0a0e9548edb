"""The benchmark machinery: workloads, arrival processes, the statistics and tables that the figures in
docs/PERFORMANCE.md come from."""
from __future__ import annotations

import argparse
import random
import statistics
import sys

import numpy as np
import pytest

from benchmarks.timeline import step_kind_table
from benchmarks.records import RequestRecord, percentile, summarize
from benchmarks.baseline_tree import without_options
from benchmarks.run_tables import ratio_table
from benchmarks.serve_bench import arrival_sets, child_argv, chunk_budget, make_target
from benchmarks.workload import load, make_chat_workload, make_system_prompt_workload, make_workload, save


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


def test_chat_workload_resends_each_conversations_history_turn_by_turn():
    """Turn t+1 of a conversation is its turn t prompt, that turn's answer, then a new question; every
    conversation starts with the one system prompt; requests come turn-major."""
    answers = lambda prompts, n: [[len(p) % 200] * n for p in prompts]  # noqa: E731 (a stand-in model)
    items = make_chat_workload(24, seed=2, system_len=40, turns=3, answer_len=5, answer=answers)
    conversations = 8
    for c in range(conversations):
        turns = [items[t * conversations + c] for t in range(3)]
        assert all(t.prompt_ids[:40] == items[0].prompt_ids[:40] for t in turns)
        for before, after in zip(turns, turns[1:]):
            said = answers([before.prompt_ids], 5)[0]
            assert after.prompt_ids[:len(before.prompt_ids) + 5] == before.prompt_ids + said
            assert len(after.prompt_ids) > len(before.prompt_ids) + 5
    system = make_system_prompt_workload(40, seed=1, systems=3, system_len=30)
    assert len({tuple(i.prompt_ids[:30]) for i in system}) == 3


def test_target_suffixes_set_reuse_and_cache_aware_admission(monkeypatch):
    import benchmarks.serve_bench as sb

    made = {}
    monkeypatch.setattr(sb.T, "EngineTarget", lambda checkpoint, **params: made.update(params) or params)
    args = argparse.Namespace(checkpoint="x", chunked_max_num_tokens=256, max_num_tokens=2048, max_batch_size=8,
                              block_size=16, num_kv_blocks=0, max_queue_delay_ms=0, dtype="float32",
                              linear_backend="auto", temperature=0.0, top_p=1.0)
    make_target("engine:fused+chunked+noreuse", args, None)
    assert not made["enable_kv_cache_reuse"] and made["enable_chunked_prefill"]
    make_target("engine:fused+cacheaware", args, None)
    assert made["enable_kv_cache_reuse"] and made["cache_aware_admission_ms"] > 0
    assert made["step_time_target_ms"] == 0
    make_target("engine:fused+chunked512+step180", args, None)
    assert made["max_num_tokens"] == 512 and made["step_time_target_ms"] == 180
    for bad in ("engine:fused+nonsense", "engine:fused+chunked+step", "engine:fused+chunked+stepfast"):
        with pytest.raises(SystemExit):
            make_target(bad, args, None)
    assert made["sampling"] == (0.0, 1.0)  # greedy unless --temperature
    args.temperature, args.top_p = 0.8, 0.9
    make_target("engine:fused", args, None)
    assert made["sampling"] == (0.8, 0.9)
    with pytest.raises(SystemExit, match="--temperature"):  # transformers' targets compare greedy runs only
        make_target("hf:static", args, None)


def test_the_in_process_target_counts_every_token_of_a_coalesced_output(monkeypatch, tiny_model):
    """When the emitter falls behind, the batch loop merges a stream's outputs: one output carries several
    tokens. The in-process target must count each (it counted one per output and lost the rest)."""
    from benchmarks import targets
    from benchmarks.workload import WorkItem
    from inflight_backend.coalesce import coalesce

    class FarBehind(targets.BatchLoop):
        """Holds every output until a request finishes, then hands them over merged: a responder far behind."""
        def __init__(self, engine, emit):
            held: list = []

            def hold(outputs, stats):
                held.extend(outputs)
                if any(out.finished for out in outputs):
                    merged = coalesce(held)
                    held.clear()
                    emit(merged, stats)
            super().__init__(engine, hold)

    monkeypatch.setattr(targets, "BatchLoop", FarBehind)
    target = targets.EngineTarget(tiny_model, max_batch_size=4, dtype="float32")
    items = [WorkItem([256, 10 + i, 20], 6 + i) for i in range(3)]
    records, _ = target.run(items, [0.0] * len(items))
    assert [len(r.token_times) for r in records] == [6, 7, 8]
    assert summarize(records)["output_tokens"] == 21


def test_attention_benchmark_cold_mode_attends_over_each_layer_cache_in_turn():
    from benchmarks.attention import _each_layer

    seen = []

    class Kernel:
        def forward(self, q, k_cache, v_cache, meta, scale):
            seen.append((k_cache, v_cache))

    caches = [("k0", "v0"), ("k1", "v1"), ("k2", "v2")]
    call = _each_layer(Kernel(), "q", caches, "meta", 0.125)
    for _ in range(7):
        call()
    assert seen == [caches[i % 3] for i in range(7)]


def test_attention_prefill_table_runs_the_given_heads_beside_a_baseline(capsys):
    from benchmarks.attention import prefill_table
    from inflight_backend.attention import NativePagedAttention, TorchPagedAttention, load_library
    import torch

    lib = load_library("cpu")
    if lib is None:
        pytest.fail("build/lib/libinflight_pa_cpu.so is missing: run `make native`")
    native, shapes = NativePagedAttention(lib, "cpu"), []

    class Baseline:  # records what it is asked, answers as the native kernel
        def forward(self, q, k_cache, v_cache, meta, scale):
            shapes.append((tuple(q.shape), tuple(k_cache.shape[2:])))
            return native.forward(q, k_cache, v_cache, meta, scale)

    prefill_table(native, TorchPagedAttention(), ["8x24"], 2, "cpu", torch.float32, (16, 4, 64), Baseline())
    header, _, row = capsys.readouterr().out.strip().splitlines()
    assert "baseline (ms) | native / baseline" in header
    assert len(row.strip("|").split("|")) == len(header.strip("|").split("|")) == 10
    assert shapes and set(shapes) == {((8, 16, 64), (4, 64))}  # 8 queries of 16 heads over 4 KV heads


def test_skinny_gemm_builds_comparison_times_the_gemm_the_engine_calls(tiny_model, capsys):
    """`skinny_gemm.py --baseline-lib`: below the AMX row threshold both builds' packed GEMM, from it (where the
    processor has AMX) their AMX GEMM; each checked against torch before it is timed."""
    from benchmarks import skinny_gemm as bench
    from inflight_backend.models import skinny_gemm

    lib = skinny_gemm.load_library()
    if lib is None:
        pytest.fail("build/lib/libinflight_sgemm_cpu.so is missing: run `make native`")
    path = skinny_gemm.LIB_DIR / "libinflight_sgemm_cpu.so"
    rows = [1, skinny_gemm.amx_min_rows(lib)]
    args = argparse.Namespace(checkpoint=tiny_model, rows=rows, repeat=1, baseline_lib=path)
    bench.compare_builds(lib, args)
    lines = capsys.readouterr().out.strip().splitlines()
    table = [line.strip("|").split("|") for line in lines[3:]]
    assert len(table) == 5 * len(rows)  # q/o, k/v, gate/up, down, LM head
    expected = ["packed", "AMX" if skinny_gemm.amx_available(lib) else "packed"] * 5
    assert [cells[2].strip() for cells in table] == expected
    assert [int(cells[1]) for cells in table] == rows * 5


def test_skinny_gemm_bf16_comparison_times_the_baseline_builds_bf16_gemm(tiny_model, capsys):
    """`skinny_gemm.py --dtype bfloat16 --baseline-lib`: the older build's bf16 GEMM in place of torch's, each
    checked against torch before it is timed; the float32 walk's settings are refused beside --dtype bfloat16."""
    from benchmarks import skinny_gemm as bench
    from inflight_backend.models import skinny_gemm

    lib = skinny_gemm.load_library()
    if not skinny_gemm.bf16_available(lib):
        pytest.skip("no AVX512-BF16 on this processor (or the library is not built): no bf16 GEMM to compare")
    path = skinny_gemm.LIB_DIR / "libinflight_sgemm_cpu.so"
    args = argparse.Namespace(checkpoint=tiny_model, rows=[1, 7], repeat=1, baseline_lib=path, ring_mb=1)
    bench.compare_bf16(lib, args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "| baseline bf16 | native bf16 |" in lines[1]
    table = [line.strip("|").split("|") for line in lines[3:]]
    assert [int(cells[1]) for cells in table] == [1, 7] * 5  # q/o, k/v, gate/up, down, LM head
    with pytest.raises(SystemExit):
        bench.main(["--checkpoint", tiny_model, "--dtype", "bfloat16", "--chunk-rows", "128"])


def test_admission_order_benchmark_admits_the_longest_output_first_when_asked(tiny_model):
    """benchmarks/admission_order.py compares first come first served with longest output first through request
    priorities; one sequence at a time, each order shows in the order requests finish."""
    from benchmarks.admission_order import run
    from benchmarks.workload import WorkItem
    from inflight_backend.config import EngineConfig
    from inflight_backend.engine import InflightEngine

    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, max_batch_size=1, max_num_tokens=64,
                                         enable_kv_cache_reuse=False, priority_aging_s=1e6))
    items = [WorkItem([256, 10 + i, 20], n) for i, n in enumerate([3, 9, 5, 7])]
    fcfs = run(engine, items, longest_first=False, tag="a")
    longest = run(engine, items, longest_first=True, tag="b")
    assert fcfs["finished"] == [0, 1, 2, 3]
    assert longest["finished"] == [1, 3, 2, 0]
    assert fcfs["tokens"] == longest["tokens"] == 24
    assert fcfs["steps"] == longest["steps"] == 24  # one sequence a step: a token each


def test_thread_cpu_sampler_finds_each_thread_of_the_matching_process():
    """benchmarks/thread_cpu.py counts CPU per thread of the processes whose command line matches, and not its
    own process (whose arguments hold the same strings)."""
    import subprocess
    import sys
    import time

    from benchmarks.thread_cpu import threads

    marker = "thread-cpu-test-marker"
    busy = ("import sys, threading, time\n"
            "def spin():\n    end = time.time() + 30\n    while time.time() < end: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", busy, marker], stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            found = {key: ticks for key, ticks in threads([marker]).items() if key[1] == child.pid}
            if len(found) >= 2 and max(found.values()) > 0:
                break
            time.sleep(0.1)
        assert len(found) >= 2 and max(found.values()) > 0  # the main thread and the spinning one
        assert all(label == marker for label, _, _ in found)
        assert not any(pid != child.pid for _, pid, _ in threads([marker]))
    finally:
        child.kill()
        child.wait()


def test_prefill_rows_baseline_is_the_forward_on_every_row(tiny_model, monkeypatch, capsys):
    """benchmarks/prefill_rows.py's `all rows` forward gives the default forward's logits (below AMX's 64 rows
    both multiply on the packed GEMM, row by row alike), and its table has a row per prompt length."""
    import types

    import torch

    from benchmarks import prefill_rows
    from inflight_backend.config import EngineConfig
    from inflight_backend.engine import InflightEngine
    from inflight_backend.request import SamplingParams

    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))
    model, execute, logits = engine.runner.model, engine.runner.execute, []
    baseline = types.MethodType(prefill_rows.all_rows_forward, model)

    def both(output, **kw):
        default = execute(output, **kw)
        model.forward, saved = baseline, model.forward
        logits.append((default.clone(), execute(output, **kw)))
        model.forward = saved
        return default

    engine.runner.execute = both
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert len(logits) == 2 and all(torch.equal(a, b) for a, b in logits)
    monkeypatch.setattr(sys, "argv", ["prefill_rows", "--checkpoint", tiny_model, "--tokens", "8", "24",
                                      "--pairs", "1"])
    prefill_rows.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["8", "24"]


def test_sse_client_counts_each_streams_tokens_and_stops_at_its_last_event():
    """The one HTTP client every server is measured through (peers, and Triton with +http), against a loopback
    server streaming server-sent events: two tokens an event, then a last event, then one that must not count."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from benchmarks import sse_client
    from benchmarks.workload import WorkItem

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["n"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(n // 2):
                self.wfile.write(b"data: " + json.dumps({"ids": [k, k]}).encode() + b"\n\n")
            self.wfile.write(b'data: {"ids": [], "last": true}\n\ndata: {"ids": [9, 9, 9]}\n\ndata: [DONE]\n\n')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        items = [WorkItem([1, 2, 3], n) for n in (4, 6, 2)]
        records = sse_client.stream_all(server.server_address[1], "fake", items, [0.0, 0.0, 0.01], None,
                                        lambda ids, n: ("/stream", {"n": n}),
                                        lambda event: (len(event["ids"]), event.get("last", False)))
    finally:
        server.shutdown()
    assert [len(r.token_times) for r in records] == [4, 6, 2]
    assert all(r.token_times == sorted(r.token_times) and r.token_times[0] >= r.arrival for r in records)


def test_triton_http_suffix_streams_over_generate_stream(monkeypatch):
    import benchmarks.serve_bench as sb

    made = {}
    monkeypatch.setattr(sb.triton_target, "TritonTarget",
                        lambda checkpoint, workdir, **params: made.update(params) or params)
    args = argparse.Namespace(checkpoint="x", chunked_max_num_tokens=256, max_num_tokens=2048, max_batch_size=8,
                              block_size=16, num_kv_blocks=0, max_queue_delay_ms=0, dtype="float32",
                              linear_backend="auto", temperature=0.0, top_p=1.0)
    from pathlib import Path
    make_target("triton:fused+http", args, Path("/tmp"))
    assert made["transport"] == "http"
    make_target("triton:fused", args, Path("/tmp"))
    assert made["transport"] == "grpc"


def test_a_baseline_rounds_arguments_are_this_runs_less_the_side_by_side_ones(tmp_path, monkeypatch):
    """serve_bench --baseline: each side's round gets the same arguments, one round, no --out of its own, and
    the checkpoint and workload as absolute paths (it runs in its own tree)."""
    monkeypatch.chdir(tmp_path)
    argv = ["--checkpoint", "models/m", "--workload=w.jsonl", "--targets", "triton:fused", "engine:fused",
            "--baseline", "HEAD~1", "--repeat", "5", "--out", "r.json", "--dtype", "bfloat16"]
    args = argparse.Namespace(checkpoint="models/m", workload="w.jsonl")
    child = child_argv(argv, args)
    assert child == ["--targets", "triton:fused", "engine:fused", "--dtype", "bfloat16",
                     "--checkpoint", str(tmp_path / "models/m"), "--workload", str(tmp_path / "w.jsonl"),
                     "--repeat", "1"]
    assert without_options(["--a", "1", "--b=2", "--c", "3"], {"--a", "--b"}) == ["--c", "3"]
