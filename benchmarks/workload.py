"""Seeded synthetic serving workloads, saved as JSONL (one request per line).

    .venv/bin/python -m benchmarks.workload --num-requests 200 --out build/bench/workload.jsonl [--long-prompts]

Prompt lengths are log-normal (median 64 tokens, clipped to 8..768); output lengths are exponential (mean 96)
capped at one of 32/96/384 chosen per request; with --long-prompts 10% of prompts have 1-2k tokens. Output
lengths are forced exactly (the backend's `min_tokens` = `max_tokens`), so every system does the same work.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    output_len: int


def make_workload(num_requests: int, seed: int = 0, vocab_size: int = 256, long_prompts: bool = False,
                  prompt_median: int = 64, output_mean: float = 96.0, max_total: int = 2048) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        if long_prompts and rng.random() < 0.10:
            prompt_len = rng.randint(1024, 2048)
        else:
            prompt_len = min(768, max(8, round(rng.lognormvariate(math.log(prompt_median), 0.8))))
        cap = rng.choice([32, 96, 384])
        output_len = max(1, min(cap, round(rng.expovariate(1.0 / output_mean))))
        prompt_len = min(prompt_len, max_total - output_len)
        items.append(WorkItem([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len))
    return items


def save(items: list[WorkItem], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(asdict(item)) + "\n")


def load(path: str | Path) -> list[WorkItem]:
    with open(path) as f:
        return [WorkItem(**json.loads(line)) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--long-prompts", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    items = make_workload(args.num_requests, args.seed, args.vocab_size, args.long_prompts)
    save(items, args.out)
    prompts = sorted(len(i.prompt_ids) for i in items)
    outputs = sorted(i.output_len for i in items)
    print(f"wrote {len(items)} requests to {args.out}: prompt tokens median {prompts[len(prompts) // 2]}, "
          f"max {prompts[-1]}; output tokens median {outputs[len(outputs) // 2]}, max {outputs[-1]}")


if __name__ == "__main__":
    main()
