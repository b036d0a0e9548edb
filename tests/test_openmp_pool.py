"""Giving back a thread's OpenMP pool: its workers exit, and the thread that builds a BatchLoop gives its own; the
engine thread computes on the threads it was given."""
import ctypes
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from inflight_backend import openmp_pool
from inflight_backend.batch_loop import BatchLoop
from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams

# In a fresh process: a parallel torch op on the main thread makes its pool (threads - 1 workers); give_back()
# must end those workers, and the next parallel op must make them again.
_CHILD = textwrap.dedent("""
    import os, sys, time
    import torch
    from inflight_backend import openmp_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settle(expected):
        deadline = time.monotonic() + 10
        while threads() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    workers = torch.get_num_threads() - 1
    before = threads()
    x = torch.ones(1 << 22)  # large enough for at::parallel_for to start a region with every thread
    with_pool = settle(before + workers)
    given = openmp_pool.give_back()
    after = settle(with_pool - workers)
    x.sum()
    again = settle(after + workers)
    print(workers, before, with_pool, given, after, again)
""")


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one CPU thread: torch starts no OpenMP workers")
def test_give_back_ends_the_calling_threads_workers_and_the_next_region_makes_them_again():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    workers, before, with_pool, given, after, again = done.stdout.split()
    workers, before, with_pool, after, again = map(int, (workers, before, with_pool, after, again))
    assert with_pool == before + workers
    assert given == "True"
    assert after == with_pool - workers
    assert again == with_pool


def test_the_thread_that_builds_a_batch_loop_gives_its_pool_back(tiny_model, monkeypatch):
    callers = []
    monkeypatch.setattr(openmp_pool, "give_back", lambda: callers.append(threading.get_ident()) or True)
    loop = BatchLoop(InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=16)), lambda *a: None)
    try:
        assert callers == [threading.get_ident()]
    finally:
        assert loop.stop()


def test_engines_sharing_the_cores_divide_torchs_threads_and_one_keeps_the_default():
    assert openmp_pool.share(1, cpus=8) == 0
    assert openmp_pool.share(2, cpus=8) == 4
    assert openmp_pool.share(3, cpus=8) == 2
    assert openmp_pool.share(4, cpus=2) == 1  # never none


def test_instance_count_sums_the_models_instance_groups():
    from inflight_backend.config import instance_count

    assert instance_count({}) == 1
    assert instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == 2
    assert instance_count({"instance_group": [{"count": "1", "kind": "KIND_CPU"}, {"count": 3}]}) == 4


def test_the_engine_thread_computes_on_the_threads_the_loop_was_given(tiny_model):
    libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=16))
    seen, step, default = [], engine.step, torch.get_num_threads()

    def recording_step():
        seen.append((torch.get_num_threads(), libgomp.omp_get_max_threads()))
        return step()

    engine.step = recording_step
    finished = threading.Event()

    def emit(outputs, stats):
        if any(out.finished for out in outputs):
            finished.set()

    loop = BatchLoop(engine, emit, threads=1)
    try:
        loop.submit("r", [1, 2, 3], SamplingParams(max_tokens=3))
        assert finished.wait(60)
        assert seen and set(seen) == {(1, 1)}
        assert "1 CPU threads" in loop.describe()
    finally:
        assert loop.stop()
        torch.set_num_threads(default)  # process-wide: the tests after this one keep torch's default
