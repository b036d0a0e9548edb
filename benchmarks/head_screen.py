"""The LM head alone: the whole head against its greedy screen (screen + refine), on a checkpoint's own hidden rows.

    .venv/bin/python benchmarks/head_screen.py --checkpoint build/models/bench-large [--dtype float32|bfloat16]
                                               [--rows 1 8 32] [--calls 30] [--repeat 3] [--steps 12]

The rows are the model's: the final norm's outputs of greedy decode steps over random prompts (an engine runs
them and keeps what the screen was given), so the screen's candidate counts are this checkpoint's, not a random
matrix's. For each row count the whole head (fp32 skinny GEMM, or the bf16 GEMM for a bfloat16 model; what
`greedy_screen: off` runs) and screen + refine (`greedy_screen: on`) are timed in turn, `--calls` calls each per
round, weights read from memory (a 256 MiB buffer is swept before each call); each figure is the median over
--repeat rounds of the rounds' medians. Also: the logits a refine recomputed a row, and whether every row's argmax
and its logit equal the whole head's.

--steps N: then whole decode steps at each row count (that many sequences at 250 tokens of context): two engines
in one process, one screening and one not (`greedy_screen: on` / `off`), N rounds of 5 steps each in turn; the
medians of the rounds' step times.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402


def hidden_rows(engine: InflightEngine, count: int, seed: int) -> torch.Tensor:
    """`count` rows the screen was given by greedy decode steps of random prompts."""
    screen = engine.runner.model.greedy_screen
    seen: list[torch.Tensor] = []
    original = screen.screen

    def keep(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.detach().clone())
        return original(x)
    screen.screen = keep
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    for i in range(8):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(64)], SamplingParams(max_tokens=count))
    while engine.has_unfinished():
        engine.step()
    screen.screen = original
    rows = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])
    return rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="build/models/bench-large")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()

    engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, dtype=args.dtype, num_kv_blocks=1024,
                                         greedy_screen="on"))
    model = engine.runner.model
    screen = model.greedy_screen
    print(f"{args.checkpoint}, {args.dtype}: {model.linear_layout}; head {screen.out_features} x "
          f"{screen.in_features}, {torch.get_num_threads()} threads")
    rows = hidden_rows(engine, max(args.rows), args.seed)
    sweep = torch.ones(64 << 20)  # 256 MiB: the head's weights leave the caches between calls

    def whole(x: torch.Tensor) -> torch.Tensor:
        return model.lm_head(x).float()

    def screened(x: torch.Tensor) -> torch.Tensor:
        y = screen.screen(x)
        screen.refine(y)
        return y

    def timed(fn, x) -> float:
        times = []
        for _ in range(args.calls):
            sweep.add_(1.0)
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    print("| rows | whole head (ms) | screen + refine (ms) | whole / screened | recomputed a row | argmax and logit |")
    print("|---:|---:|---:|---:|---:|---|")
    for count in args.rows:
        x = rows[:count].contiguous()
        exact, approx = whole(x), screened(x)
        same = (torch.equal(approx.argmax(1), exact.argmax(1))
                and torch.equal(approx.max(1).values, exact.max(1).values))
        before = screen.recomputed
        screened(x)
        recomputed = (screen.recomputed - before) / count
        rounds = [(timed(whole, x), timed(screened, x)) for _ in range(args.repeat)]
        a, b = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        print(f"| {count} | {a:.3f} | {b:.3f} | {a / b:.2f} | {recomputed:.1f} | {'equal' if same else 'DIFFER'} |")
    if args.steps:
        del engine, model, screen, rows
        decode_steps(args)


def decode_steps(args) -> None:
    """Decode steps with and without the screen, two engines interleaved in one process (--steps)."""
    print("| sequences | screened step (ms) | whole-head step (ms) | whole / screened |")
    print("|---:|---:|---:|---:|")
    for count in args.rows:
        engines = {}
        for mode in ("on", "off"):
            engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, dtype=args.dtype, num_kv_blocks=4096,
                                                 max_batch_size=max(args.rows), max_num_tokens=8192,
                                                 greedy_screen=mode))
            rng = random.Random(args.seed + count)
            for i in range(count):
                engine.add_request(str(i), [rng.randrange(3, engine.runner.vocab_size) for _ in range(250)],
                                   SamplingParams(max_tokens=10 * args.steps + 8, min_tokens=10 * args.steps + 8))
            for _ in range(4):  # the prompts, then warm decode steps
                engine.step()
            engines[mode] = engine
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.steps):
            for mode, engine in engines.items():
                start = time.perf_counter()
                for _ in range(5):
                    engine.step()
                times[mode].append((time.perf_counter() - start) / 5 * 1e3)
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"| {count} | {on:.2f} | {off:.2f} | {off / on:.2f} |")
        del engines


if __name__ == "__main__":
    main()
