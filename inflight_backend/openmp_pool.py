"""One thread computes: giving back the OpenMP thread pool of a thread that is done computing.

GNU OpenMP (libgomp, torch's and our CPU kernels') keeps a pool of worker threads per thread that starts a
parallel region. Between regions a worker spins for a while (~3 ms) before it sleeps, so the next region starts
at once; but while libgomp manages more threads than the process has CPUs, it spins only 100 times, and every
region then pays a futex wake and the sleeping worker's wake-up. A pool stays for the life of its thread, idle or
not: a model loaded on one thread (Triton's `initialize()`, a benchmark's main thread) leaves that thread's pool
behind, and once the engine thread starts its own, the process holds more workers than CPUs. Every step's
regions then wake a sleeping worker (at 32 sequences on the medium model: ~115 sleeps a step, the step 20-50%
slower than on a process with one pool). `give_back()`, on the thread that loaded the model, frees its pool
(OpenMP 5's `omp_pause_resource_all`), so the engine thread's is the only one. `share()` and `use_threads()`
size that pool when several engines share the machine's cores.
"""
from __future__ import annotations

import ctypes
import os

import torch

_OMP_PAUSE_SOFT = 1
_LIBGOMP = "libgomp.so.1"


def share(instances: int, cpus: int | None = None) -> int:
    """Threads for each of `instances` engines computing in their own processes on the same cores: torch's
    default count (`cpus`) divided among them, at least one each; 0 (keep the default) for one engine.
    Spinning OpenMP threads of several processes on the same cores wait at every barrier for a partner that
    is not running: two engines of 2 threads each on 2 cores ran their decode steps 3.4-4.4x slower than one
    alone (docs/PERFORMANCE.md, "Several engines on the same cores")."""
    if instances <= 1:
        return 0
    return max(1, (cpus if cpus is not None else torch.get_num_threads()) // instances)


def use_threads(count: int) -> None:
    """The calling thread's parallel regions (torch's and our kernels') use `count` threads: torch's intra-op
    count is process-wide, OpenMP's is the calling thread's own (a thread OpenMP did not start takes the
    process default, not another thread's setting), so the thread that computes calls this itself."""
    torch.set_num_threads(count)


def give_back() -> bool:
    """Free the calling thread's OpenMP pool (its workers exit; a later region makes a new one). False when no
    libgomp is loaded (another OpenMP runtime, or none) or it refused (called inside a parallel region)."""
    try:  # only the runtime already loaded (torch's): never load a second one
        libgomp = ctypes.CDLL(_LIBGOMP, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return libgomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
