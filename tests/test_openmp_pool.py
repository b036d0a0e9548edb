"""Giving back a thread's OpenMP pool: its workers exit, and the thread that builds a BatchLoop gives its own."""
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
