"""The markdown tables serve_bench prints from its runs (the dicts of benchmarks/records.py's `summarize`, with
their target, load and round): one row per run, and per-round ratios of one target's figure over another's."""
from __future__ import annotations

from collections import Counter

from benchmarks.records import percentile


def ratio_table(runs: list[dict], pairs: list[tuple[str, str]], metric: str = "output_tokens_per_s") -> str:
    """`metric` of A over B for each (A, B), per round (same load point), and their median. Load points are
    matched by their position in the round, so --load-fraction rounds (one rate each) line up too."""
    by: dict = {}
    seen: Counter = Counter()  # seen: load points so far of each (round, target), in run order
    for r in runs:
        point = -1
        if r["load"] != "saturation":
            point = seen[(r["round"], r["target"])]
            seen[(r["round"], r["target"])] += 1
        by[(r["round"], point, r["target"])] = r
    rounds = sorted({r["round"] for r in runs})
    lines = [f"| load | A / B ({metric}) | per round | median |", "|---|---|---|---:|"]
    for point in sorted({key[1] for key in by}):
        for a, b in pairs:
            pairs_found = [(by[(n, point, a)], by[(n, point, b)]) for n in rounds
                           if (n, point, a) in by and (n, point, b) in by]
            if pairs_found:
                ratios = [x[metric] / y[metric] for x, y in pairs_found]
                load = " ".join(dict.fromkeys(x["load"] for x, _ in pairs_found))
                lines.append(f"| {load} | {a} / {b} | {' '.join(f'{x:.2f}' for x in ratios)} | "
                             f"{percentile(ratios, 50):.2f} |")
    return "\n".join(lines)


def table(runs: list[dict]) -> str:
    head = ("| target | load | out tok/s | req/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | E2E p99 (s) | "
            "overhead | preempt | prefix hit |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [f"| {r['target']}{_round(r)} | {r['load']} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
            f"{r['itl_p50_s'] * 1e3:.1f} / {r['itl_p99_s'] * 1e3:.1f} | "
            f"{r['e2e_p99_s']:.2f} | {_pct(r.get('overhead_fraction'))} | {r.get('preemptions', '')} | "
            f"{_pct(_hit_rate(r))} |" for r in runs]
    return "\n".join([head, *rows])


def _hit_rate(run: dict) -> float | None:
    """Prompt tokens served from the prefix cache over all prompt tokens (cached + computed)."""
    cached, computed = run.get("cached_prompt_tokens"), run.get("computed_prompt_tokens")
    return None if cached is None or computed is None else cached / max(cached + computed, 1)


def _round(run: dict) -> str:
    return f" (round {run['round'] + 1})" if run.get("round") else ""


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"

