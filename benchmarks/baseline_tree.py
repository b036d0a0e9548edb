"""An older commit built beside this tree, for benchmarks that time two commits side by side (`--baseline REV`).

build/baseline/COMMIT is a git worktree of REV with its own native kernels built; a benchmark runs its own copy
of itself there (its backend, engine and server code, in their own processes), round by round against this tree.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def baseline_tree(rev: str, root: Path = ROOT) -> Path:
    """build/baseline/COMMIT: a worktree of `rev` with its own native kernels built (without them its engine would
    fall back to torch's ops and measure something this tree does not run), made once per commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.strip()
    tree = root / "build" / "baseline" / commit
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=root, check=True)
    if not (tree / "build" / "lib").is_dir():
        build = tree / "build" / "cmake"
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j"], check=True, stdout=subprocess.DEVNULL)
    return tree


def commit_label(root: Path = ROOT) -> str:
    """The tree's short commit, with + where it has uncommitted changes to tracked files; ? outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
        return head + "+" if changed else head
    except (OSError, subprocess.CalledProcessError):
        return "?"


def without_options(argv: list[str], names: set[str]) -> list[str]:
    """`argv` less each option in `names` and its one value (`--name value` or `--name=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names:
            out.append(arg)
    return out
