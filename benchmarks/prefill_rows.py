"""A prompt's step with the last layer past attention on every row, against the sampled rows alone (the default):

    .venv/bin/python benchmarks/prefill_rows.py --checkpoint build/models/bench-large --tokens 512 --pairs 16

Only a prompt's last token is sampled, so `LlamaForCausalLM.forward` runs the last layer's o projection and MLP
on the sampled rows alone (every layer still writes every token's K and V). This times one-prompt prefill steps
of `--tokens` tokens in one process, the two forwards alternating step by step (`all rows` is the forward as it
was before, kept here as the baseline), and prints the medians and the median of the pairs' ratios: on a noisy
machine a pair's two steps run seconds apart, not minutes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight_backend.config import EngineConfig  # noqa: E402
from inflight_backend.engine import InflightEngine  # noqa: E402
from inflight_backend.request import SamplingParams  # noqa: E402


def all_rows_forward(self, input_ids, positions, kv_caches, meta, sample_indices, screen=False):
    """The forward before sampled rows: every row through the last layer, then the sampled ones gathered."""
    h = self.model.embed_tokens(input_ids)
    rope = self.model.rotary.tables(positions, h.dtype)
    if self.decoder_stack is not None:
        h, residual = self.decoder_stack(h, rope, kv_caches, meta)
    else:
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, rope, kv_cache, meta)
    x, _ = self.model.norm(h[sample_indices], residual[sample_indices])
    if screen and self.greedy_screen is not None:
        return self.greedy_screen.screen(x)
    return self.lm_head(x).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="build/models/bench-medium")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512])
    parser.add_argument("--pairs", type=int, default=16)
    args = parser.parse_args()
    engine = InflightEngine(EngineConfig(checkpoint=args.checkpoint, max_batch_size=8, max_num_tokens=max(args.tokens),
                                         num_kv_blocks=0, enable_kv_cache_reuse=False))
    model = engine.runner.model
    forwards = {"all rows": types.MethodType(all_rows_forward, model), "sampled rows": model.forward}
    print(f"{args.checkpoint}: {engine.runner.describe()}")
    print("| prompt tokens | all rows (ms, median) | sampled rows (ms, median) | all / sampled, median of pairs "
          "(IQR) |")
    print("|---:|---:|---:|---:|")
    for tokens in args.tokens:
        prompt = [(i * 7919) % 250 for i in range(tokens)]
        times: dict[str, list[float]] = {name: [] for name in forwards}
        for pair in range(args.pairs):
            for name, forward in forwards.items():
                model.forward = forward
                engine.add_request(f"{name} {tokens} {pair}", prompt, SamplingParams(max_tokens=1))
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
                while engine.has_unfinished():
                    engine.step()
        ratios = sorted(a / b for a, b in zip(times["all rows"], times["sampled rows"]))
        quarter = len(ratios) // 4
        print(f"| {tokens} | {statistics.median(times['all rows']) * 1e3:.1f} | "
              f"{statistics.median(times['sampled rows']) * 1e3:.1f} | {statistics.median(ratios):.3f} "
              f"({ratios[quarter]:.3f}-{ratios[-1 - quarter]:.3f}) |")
    model.forward = forwards["sampled rows"]


if __name__ == "__main__":
    main()
