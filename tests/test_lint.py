"""The code passes the checkers pyproject.toml configures: ruff (pyflakes, pycodestyle, pyupgrade to 3.10) on
everything, mypy on the package."""
import subprocess
import sys

from inflight_backend.paths import PROJECT_ROOT


def test_ruff_reports_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_reports_nothing():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
