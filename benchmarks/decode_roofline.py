"""Decode step time against batch size, next to the memory floor of streaming the weights once per step.

    .venv/bin/python benchmarks/decode_roofline.py --checkpoint build/models/bench-medium [--batches 1 2 4 8 16 32]
                                                   [--dtype float32|bfloat16] [--linear-backend auto|native|torch]
                                                   [--steps 30] [--repeat 3]

Every decode step reads every weight except the embedding table (gathered, not streamed) and does 2 FLOPs per
weight per sequence. The floor of a step is the larger of: those bytes over the read bandwidth measured here
(a reduction over a tensor of the same size), and those FLOPs over the GEMM peak measured here (a 2048^3 matmul
in the same dtype). Steps are timed in-process (engine.step(): schedule + model + sample) with every
sequence at a 64-token prompt; each figure is the best of --repeat runs of --steps steps.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402


def streamed_bytes(engine: InflightEngine) -> int:
    model = engine.runner.model
    embedding = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)  # packing pads


def read_bandwidth(num_bytes: int, repeat: int) -> float:
    x = torch.ones(num_bytes // 4)
    best = min(_timed(x.sum) for _ in range(max(repeat, 5)))
    return num_bytes / best


def gemm_peak(dtype: torch.dtype, repeat: int) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048 ** 3 / min(_timed(lambda: a @ b) for _ in range(max(repeat, 5)))


def step_time(engine: InflightEngine, batch: int, steps: int, repeat: int, tag: str) -> float:
    rng = random.Random(batch)
    total = steps * repeat + 8
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(3, engine.runner.vocab_size) for _ in range(64)],
                           SamplingParams(max_tokens=total, min_tokens=total))
    for _ in range(6):  # prefill, then warm decode steps
        engine.step()
    best = min(_timed(lambda: [engine.step() for _ in range(steps)]) for _ in range(repeat)) / steps
    while engine.has_unfinished():
        engine.step()
    return best


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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, dtype=args.dtype, max_batch_size=max(args.batches),
                                         max_num_tokens=max(2048, 64 * max(args.batches)),
                                         linear_backend=args.linear_backend))
    weights = streamed_bytes(engine)
    params = weights // engine.runner.dtype.itemsize
    bandwidth = read_bandwidth(weights, args.repeat)
    peak = gemm_peak(engine.runner.dtype, args.repeat)
    print(f"{engine.runner.describe()}; {torch.get_num_threads()} threads; weights streamed per step "
          f"{weights / 1e6:.0f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.0f} GFLOP/s")
    print("| batch | step (ms) | tokens/s | memory floor (ms) | compute floor (ms) | step / floor | GFLOP/s |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        t = step_time(engine, batch, args.steps, args.repeat, f"b{batch}")
        memory, compute = weights / bandwidth, 2 * params * batch / peak
        print(f"| {batch} | {t * 1e3:.2f} | {batch / t:.0f} | {memory * 1e3:.2f} | {compute * 1e3:.2f} | "
              f"{t / max(memory, compute):.2f} | {2 * params * batch / t / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
