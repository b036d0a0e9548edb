"""Decode step time against batch size, next to the memory floor of streaming the weights once per step.

    .venv/bin/python benchmarks/decode_roofline.py --checkpoint build/models/bench-medium [--batches 1 2 4 8 16 32]
                                                   [--dtype float32|bfloat16] [--linear-backend auto|native|torch]
                                                   [--steps 30] [--repeat 3] [--profile]
                                                   [--greedy-screen auto|on|off]
                                                   [--temperature T [--top-k K] [--top-p P]]

Every decode step reads every weight except the embedding table (gathered, not streamed) and does 2 FLOPs per
weight per sequence. The floor of a step is the larger of: those bytes over the read bandwidth measured here
(a reduction over a tensor of the same size), and those FLOPs over the GEMM peak measured here (a 2048^3 matmul
in the same dtype: the higher of torch's and, in float32, our packed skinny GEMM's). Steps are timed in-process
(engine.step(): schedule + model + sample) with every sequence at a --context-token prompt (64 by default; the
floor's bytes count the K and V of that many tokens a sequence too); each figure is the best of
--repeat runs of --steps steps.

When the model runs its layers in one native call (models/decoder_stack.py), each batch is also timed through
its modules, the two alternating: the last two columns.

--profile: then, at the largest batch, where a decode step's time goes: torch.profiler over --steps steps, each
operator's share (our native kernels appear as their custom ops), and the step's time outside any operator
(Python: scheduling, sampling, the runner's inputs); with the layers in one call (`dec_forward_f32`), the same
again through the modules, which shows that call's kernels one by one.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402
from inflight_backend.models import skinny_gemm  # noqa: E402

GREEDY = SamplingParams(max_tokens=1)  # every request of a timing: greedy, unless --temperature


def streamed_bytes(engine: InflightEngine) -> int:
    model = engine.runner.model
    # Not streamed: the embedding table (gathered) and the AMX form of the weights (decode steps have fewer rows
    # than amx_min_rows, so they read the fp32 panels). The LM head counts as fp32 even where a greedy screen
    # (models/greedy_screen.py, not a parameter) reads its bf16 copy instead: the floor is the fp32 model's.
    skipped = {id(model.model.embed_tokens.weight)} | {id(m.amx_packed) for m in model.modules()
                                                       if getattr(m, "amx_packed", None) is not None}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skipped)  # packing pads


def read_bandwidth(num_bytes: int, repeat: int) -> float:
    x = torch.ones(num_bytes // 4)
    best = min(_timed(x.sum) for _ in range(max(repeat, 5)))
    return num_bytes / best


def gemm_peak(dtype: torch.dtype, repeat: int) -> tuple[float, float | None]:
    """FLOP/s of a 2048^3 matmul: torch's (MKL), and, in float32 with the library built, our packed skinny GEMM's
    (on some processors, AMD's Zen 5 among them, it is twice MKL's). The compute floor takes the higher."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    flops, runs = 2 * 2048 ** 3, max(repeat, 5)
    mkl = flops / min(_timed(lambda: a @ b) for _ in range(runs))
    lib = skinny_gemm.load_library() if dtype == torch.float32 else None
    if lib is None:
        return mkl, None
    packed = skinny_gemm.pack(lib, b)
    return mkl, flops / min(_timed(lambda: skinny_gemm.gemm(lib, a, packed, 2048, None)) for _ in range(runs))


def step_time(engine: InflightEngine, batch: int, context: int, steps: int, repeat: int,
              tag: str, sampling: SamplingParams = GREEDY) -> tuple[float, float | None]:
    """The best step time over `repeat` runs of `steps` steps, and, when the model runs its layers in one native
    call (models/decoder_stack.py), the same through its modules, the two runs alternating."""
    model = engine.runner.model
    stack = model.decoder_stack
    modes = [stack] if stack is None else [stack, None]
    rng = random.Random(batch)
    total = steps * repeat * len(modes) + 8
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(3, engine.runner.vocab_size) for _ in range(context)],
                           replace(sampling, max_tokens=total, min_tokens=total))
    for _ in range(6):  # prefill, then warm decode steps
        engine.step()
    best = [float("inf")] * len(modes)
    for _ in range(repeat):
        for i, mode in enumerate(modes):
            with _decoder_stack(model, mode):
                best[i] = min(best[i], _timed(lambda: [engine.step() for _ in range(steps)]) / steps)
    while engine.has_unfinished():
        engine.step()
    return best[0], (best[1] if len(modes) > 1 else None)


@contextlib.contextmanager
def _decoder_stack(model, stack):
    """Run the model's layers through `stack` (None: through its modules) inside the block."""
    saved, model.decoder_stack = model.decoder_stack, stack
    try:
        yield
    finally:
        model.decoder_stack = saved


def profile(engine: InflightEngine, batch: int, context: int, steps: int, top: int = 14,
            sampling: SamplingParams = GREEDY) -> str:
    """A markdown table: the operators taking the most of `steps` decode steps at `batch`, per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rng = random.Random(batch)
    total = steps + 8
    for i in range(batch):
        engine.add_request(f"p-{i}", [rng.randrange(3, engine.runner.vocab_size) for _ in range(context)],
                           replace(sampling, max_tokens=total, min_tokens=total))
    for _ in range(6):
        engine.step()
    with _native_kernels_labelled(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    while engine.has_unfinished():
        engine.step()
    events = list(prof.key_averages())
    # self time: each operator's own time, children excluded, so the rows add up to the time inside operators
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    inside = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    lines = [f"batch {batch}: {wall * 1e3:.2f} ms a step (profiled), {inside * 1e3:.2f} ms inside operators",
             "| operator | calls a step | ms a step | share of the step |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        ms = e.self_cpu_time_total / 1e3 / steps
        lines.append(f"| {e.key} | {e.count / steps:.0f} | {ms:.2f} | {ms / (wall * 1e3):.1%} |")
    lines.append(f"| (outside operators: Python) | | {(wall - inside) * 1e3:.2f} | {(wall - inside) / wall:.1%} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _native_kernels_labelled():
    """Our kernels are ctypes calls, which the profiler does not see: while profiling, each C function the process
    has called through a ctypes library (paged attention, skinny GEMM, fused ops) runs inside a record_function
    of its name."""
    from torch.profiler import record_function

    def labelled(fn, name):
        def call(*args):
            with record_function(name):
                return fn(*args)
        return call

    patched = []
    for lib in [o for o in gc.get_objects() if isinstance(o, ctypes.CDLL)]:
        for name, fn in list(vars(lib).items()):
            if isinstance(fn, ctypes._CFuncPtr):
                setattr(lib, name, labelled(fn, name))
                patched.append((lib, name, fn))
    try:
        yield
    finally:
        for lib, name, fn in patched:
            setattr(lib, name, fn)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--linear-backend", default="auto", choices=["auto", "native", "torch"])
    parser.add_argument("--temperature", type=float, default=0.0, help="every request samples (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy-screen", default="auto", choices=["auto", "on", "off"],
                        help="the LM head of these greedy steps through its bf16 screen (greedy_screen); the floors "
                             "stay the fp32 head's")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens of every sequence")
    parser.add_argument("--profile", action="store_true", help="then break a step at the largest batch down")
    args = parser.parse_args(argv)
    sampling = SamplingParams(max_tokens=1, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0)
    most = max(args.batches)
    per_seq = args.context + args.steps * (2 * args.repeat + 1) + 16  # tokens a sequence reaches, and to spare
    engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, dtype=args.dtype, max_batch_size=most,
                                         max_num_tokens=max(2048, args.context * most),
                                         num_kv_blocks=max(512, most * (per_seq // 16 + 1)),
                                         linear_backend=args.linear_backend, greedy_screen=args.greedy_screen))
    weights = streamed_bytes(engine)
    cfg = engine.runner.model.config  # K and V of one token in every layer:
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * engine.runner.dtype.itemsize
    params = weights // engine.runner.dtype.itemsize
    bandwidth = read_bandwidth(weights, args.repeat)
    mkl, native = gemm_peak(engine.runner.dtype, args.repeat)
    peak = max(mkl, native or 0.0)
    print(f"{engine.runner.describe()}; {torch.get_num_threads()} threads; weights streamed per step "
          f"{weights / 1e6:.0f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.0f} GFLOP/s "
          f"(2048^3: torch {mkl / 1e9:.0f}" + ("" if native is None else f", packed skinny GEMM {native / 1e9:.0f}")
          + ")")
    print("| batch | step (ms) | tokens/s | memory floor (ms) | compute floor (ms) | step / floor | GFLOP/s "
          "| through the modules (ms) | modules / one call |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        t, modules = step_time(engine, batch, args.context, args.steps, args.repeat, f"b{batch}", sampling)
        memory, compute = (weights + batch * args.context * kv_per_token) / bandwidth, 2 * params * batch / peak
        apart = "| - | - |" if modules is None else f"| {modules * 1e3:.2f} | {modules / t:.2f} |"
        print(f"| {batch} | {t * 1e3:.2f} | {batch / t:.0f} | {memory * 1e3:.2f} | {compute * 1e3:.2f} | "
              f"{t / max(memory, compute):.2f} | {2 * params * batch / t / 1e9:.0f} {apart}", flush=True)
    if args.profile:
        print(profile(engine, most, args.context, args.steps, sampling=sampling))
        if engine.runner.model.decoder_stack is not None:  # its kernels run inside one C call: the module
            with _decoder_stack(engine.runner.model, None):  # path shows them one by one
                print("\nThe same through the modules (the same kernels, called from Python):")
                print(profile(engine, most, args.context, args.steps, sampling=sampling))


if __name__ == "__main__":
    main()
