"""Seeded synthetic serving workloads, saved as JSONL (one request per line).

    .venv/bin/python -m benchmarks.workload --num-requests 200 --out build/bench/workload.jsonl [--long-prompts]
    .venv/bin/python -m benchmarks.workload --shared-prefix chat --num-requests 96 --out build/bench/chat.jsonl

Prompt lengths are log-normal (median 64 tokens, clipped to 8..768); output lengths are exponential (mean 96)
capped at one of 32/96/384 chosen per request; with --long-prompts 10% of prompts have 1-2k tokens. Output
lengths are forced exactly (the backend's `min_tokens` = `max_tokens`), so every system does the same work.

Shared prefixes (prefix caching): `--shared-prefix chat` makes multi-turn conversations under one system prompt,
each turn resending the whole conversation so far (the earlier answers are the workload's own tokens, not what
the model said, unless `--answers-from`: then the whole history can be reused); requests are ordered turn by
turn, so with a closed loop (`--mode concurrency`) a turn comes after its predecessor. `--shared-prefix system`
makes N long system prompts, each shared by many short questions.
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


def make_chat_workload(num_requests: int, seed: int = 0, vocab_size: int = 256, system_len: int = 256,
                       turns: int = 4, question_median: int = 32, answer_len: int = 48,
                       answer=None) -> list[WorkItem]:
    """num_requests / turns conversations of `turns` turns, turn-major order. `answer(prompts, n)` gives each
    turn's answers (what the model says, so the next turn resends it); default: random tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_len)]
    conversations = max(1, num_requests // turns)
    histories = [list(system) for _ in range(conversations)]
    items = []
    for _ in range(turns):
        for history in histories:
            history += [rng.randrange(vocab_size) for _ in range(max(4, round(rng.lognormvariate(
                math.log(question_median), 0.5))))]
            items.append(WorkItem(list(history), answer_len))
        answers = answer([list(h) for h in histories], answer_len) if answer else \
            [[rng.randrange(vocab_size) for _ in range(answer_len)] for _ in histories]
        for history, said in zip(histories, answers):
            history += said
    return items[:num_requests]


def greedy_answers(checkpoint: str):
    """answer(prompts, n): the backend's own greedy tokens (n forced, float32), as every target will produce them."""
    from inflight_backend.config import EngineConfig
    from inflight_backend.engine import InflightEngine
    from inflight_backend.request import SamplingParams

    engine = InflightEngine(EngineConfig(checkpoint=checkpoint, dtype="float32", num_kv_blocks=0, max_batch_size=32,
                                         max_num_tokens=4096))

    def answer(prompts: list[list[int]], n: int) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, min_tokens=n))
        said: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                said[out.req_id] += out.token_ids
        return [said[str(i)] for i in range(len(prompts))]

    return answer


def make_system_prompt_workload(num_requests: int, seed: int = 0, vocab_size: int = 256, systems: int = 4,
                                system_len: int = 512, question_median: int = 32,
                                output_len: int = 64) -> list[WorkItem]:
    """`systems` system prompts, each request one of them (at random) plus a short question."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(system_len)] for _ in range(systems)]
    return [WorkItem(rng.choice(prompts) + [rng.randrange(vocab_size) for _ in range(
        max(4, round(rng.lognormvariate(math.log(question_median), 0.5))))], output_len)
        for _ in range(num_requests)]


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
    parser.add_argument("--shared-prefix", choices=["chat", "system"],
                        help="multi-turn chats resending their history, or a few long system prompts")
    parser.add_argument("--answers-from", metavar="CHECKPOINT",
                        help="chat: each turn resends the answers this checkpoint gives (greedy), as a real chat "
                             "resends what the model said; default: random answer tokens")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.shared_prefix == "chat":
        answer = greedy_answers(args.answers_from) if args.answers_from else None
        items = make_chat_workload(args.num_requests, args.seed, args.vocab_size, answer=answer)
    elif args.shared_prefix == "system":
        items = make_system_prompt_workload(args.num_requests, args.seed, args.vocab_size)
    else:
        items = make_workload(args.num_requests, args.seed, args.vocab_size, args.long_prompts)
    save(items, args.out)
    prompts = sorted(len(i.prompt_ids) for i in items)
    outputs = sorted(i.output_len for i in items)
    print(f"wrote {len(items)} requests to {args.out}: prompt tokens median {prompts[len(prompts) // 2]}, "
          f"max {prompts[-1]}; output tokens median {outputs[len(outputs) // 2]}, max {outputs[-1]}")


if __name__ == "__main__":
    main()
