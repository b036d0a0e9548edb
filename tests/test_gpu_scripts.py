"""The one-shot GPU script (benchmarks/gpu_check.sh) gets a GPU only rarely and for minutes: what of it runs
without one is run here, so that a GPU session is not spent on a typo. The engine check's own CPU mode runs the
same code with small shapes; the kernel check says there is no device and stops."""
import subprocess
import sys

import pytest
import torch

from inflight_backend.paths import PROJECT_ROOT


def test_the_shell_script_parses():
    done = subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=PROJECT_ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_the_engine_check_runs_on_the_cpu_with_small_shapes():
    done = subprocess.run([sys.executable, "benchmarks/gpu_engine_check.py", "--device", "cpu", "--big", "small",
                           "--streams", "8", "--profile", "1"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "oracle float32 on cpu: 12 of 12 requests equal transformers' greedy tokens" in done.stdout
    assert "saturated small bf16, 8 streams of 128 in / 128 out" in done.stdout
    assert "profile: 1 decode steps at 8 streams" in done.stdout and "Self CPU time total" in done.stdout
    assert "oracle float32 on cpu, cuda_fused_ops auto: 12 of 12" in done.stdout  # the fused ops' section ran
    assert "fused CUDA ops / without at 8 streams" in done.stdout
    assert "sampled / greedy at 8 streams" in done.stdout
    assert done.stdout.rstrip().endswith("ENGINE CHECKS OK")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: gpu_check.sh runs for real")
def test_the_kernel_check_without_a_device_says_so():
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert "no CUDA device" in done.stdout + done.stderr


def test_the_attention_benchmark_times_a_baseline_build_beside_this_one():
    """gpu_check.sh's decode table at a model's heads, back-to-back calls, an older build beside this one: the
    same code on the CPU kernel, timed against itself."""
    from inflight_backend.attention.kernel_abi import library_path

    lib = library_path("cpu")
    if not lib.exists():
        pytest.skip(f"{lib} is not built (make native)")
    done = subprocess.run([sys.executable, "benchmarks/attention.py", "--batches", "2", "--contexts", "40",
                           "--shape", "4", "2", "128", "--calls", "2", "--repeat", "1", "--baseline-lib", str(lib)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    header, rule, row = done.stdout.splitlines()[1:4]
    assert "| baseline (ms) | native / baseline |" in header
    assert header.count("|") == rule.count("|") == row.count("|") == 11
    assert "4 heads / 2 KV heads, head size 128, 2 call(s) a timing" in done.stdout
