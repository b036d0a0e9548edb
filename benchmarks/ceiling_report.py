"""What serving_ceiling.py prints: each (transport, streams) row's median round, the table of one or two trees'
results side by side, and the lines under it (a step's split in process, execute() calls, one stream's gap,
tokens missing). Imported from beside the script by its top-level name, as its other harness modules."""
from __future__ import annotations

IN_PROCESS = ("inprocess", "inprocess-ids")


def median_rounds(rounds: list[dict]) -> dict:
    """Each row's median round (by tokens/s), with every round's tokens/s in `rounds`."""
    runs = []
    for i in range(len(rounds[0]["runs"])):
        row = [r["runs"][i] for r in rounds]
        median = sorted(row, key=lambda run: run["tokens_per_s"])[len(row) // 2]
        runs.append({**median, "rounds": [run["tokens_per_s"] for run in row]})
    return {"commit": rounds[0]["commit"], "runs": runs}


def table(results: list[dict]) -> str:
    """One row per (transport, streams); for each result set its tokens/s and CPU ms per 1k tokens; ratios."""
    head = "| transport | streams |"
    rule = "|---|---:|"
    for r in results:
        head += (f" {r['commit']} tokens/s | {r['commit']} server CPU ms / 1k tokens (triton + stub) |"
                 f" {r['commit']} client |")
        rule += "---:|---:|---:|"
    if len(results) == 2:
        head += f" {results[1]['commit']} / {results[0]['commit']} |"
        rule += "---:|"
    lines = [head, rule]
    keys = [(r["transport"], r["streams"]) for r in results[-1]["runs"]]
    for key in keys:
        row = f"| {key[0]} | {key[1]} |"
        found = []
        for r in results:
            run = next((x for x in r["runs"] if (x["transport"], x["streams"]) == key), None)
            found.append(run)
            if run is None:
                row += " - | - | - |"
                continue
            cpu = run["cpu_ms_per_1k"]
            server = (f"{cpu['tritonserver']:.0f} + {cpu['stub']:.0f}" if "stub" in cpu
                      else f"{cpu['engine']:.1f} (engine)")
            client = f"{cpu['client']:.0f}" if "client" in cpu else "-"
            spread = ""
            if len(run.get("rounds", [])) > 1:
                spread = f" ({min(run['rounds']):,.0f}-{max(run['rounds']):,.0f})"
            row += f" {run['tokens_per_s']:,.0f}{spread} | {server} | {client} |"
        if len(results) == 2 and None not in found:
            row += f" {found[1]['tokens_per_s'] / found[0]['tokens_per_s']:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def notes(results: list[dict]) -> list[str]:
    """The lines printed under the table."""
    lines = []
    for r in results:
        for run in r["runs"]:
            where = f"{r['commit']} {run['transport']} {run['streams']}"
            if run["transport"] in IN_PROCESS:
                split = ", ".join(f"{k} {v:.3f}" for k, v in run["split_ms"].items())
                lines.append(f"{where}: {run['step_ms']:.3f} ms a step ({split} ms)")
            elif run.get("executions"):
                lines.append(f"{where}: {run['executions']} execute() calls for {run['streams']} requests")
            if run.get("itl_p50_ms") is not None and run["streams"] == 1:
                gap = run["itl_p50_ms"]
                lines.append(f"{r['commit']} {run['transport']} 1 stream: inter-token gap p50 {gap:.3f} ms")
            if run["transport"] not in IN_PROCESS and (run.get("errors") or run["tokens"] != run["expected_tokens"]):
                lines.append(f"{where}: {run['tokens']} of {run['expected_tokens']} tokens; "
                             f"errors: {run.get('errors')}")
    return lines
