"""The fused CUDA ops (plugins/cuda_ops, models/cuda_ops.py, `cuda_fused_ops`): against the torch modules they
replace on a GPU (rotary and SiLU-and-multiply bitwise, the RMSNorm within its sum's reordering), the engine's
greedy tokens with and without them; here without one, the setting's checks, the library's ABI and the torch
fallback for tensors the kernels do not take."""
import shutil

import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.models import cuda_ops
from inflight_backend.models.llama import RMSNorm, apply_rotary, silu_mul
from inflight_backend.request import SamplingParams

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernels not run")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def test_setting_is_checked_and_refused_where_it_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="cuda_fused_ops must be one of"):
        EngineConfig(checkpoint=tiny_model, cuda_fused_ops="yes")
    with pytest.raises(ValueError, match="cuda_fused_ops: on applies to engine: pytorch"):
        EngineConfig(checkpoint=tiny_model, engine="null", cuda_fused_ops="on")
    with pytest.raises(RuntimeError, match="cuda_fused_ops: on applies to CUDA models"):
        InflightEngine(EngineConfig(checkpoint=tiny_model, device="cpu", cuda_fused_ops="on"))
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, device="cpu", cuda_fused_ops="auto"))
    assert "fused CUDA ops" not in engine.runner.describe()  # auto: a CPU model keeps its own ops


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: the CUDA library is not built")
def test_library_is_built_and_exports_the_abi():
    lib = cuda_ops.load_library()  # loads without a GPU: the CUDA runtime is linked statically
    assert lib is not None, "nvcc is available but build/lib/libinflight_ops_cuda.so is missing"
    for name in ("cops_add_rms_norm", "cops_rotary", "cops_silu_mul"):
        assert hasattr(lib, name)


class Unused:
    """A library stand-in for tensors the kernels do not take: any call fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} called for a tensor the CUDA kernels do not take")


def test_tensors_the_kernels_do_not_take_go_through_torch():
    """CPU tensors (and any layout but contiguous rows) take the torch modules' path, with the same results."""
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data.normal_()
    fused = cuda_ops.CudaRMSNorm(norm, Unused())
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    assert torch.equal(fused(x), norm(x))
    got, got_residual = fused(x, residual.clone())
    want, want_residual = norm(x, residual.clone())
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)
    q, k, cos, sin = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    for got, want in zip(cuda_ops._rotary_pair(Unused(), q, k, cos, sin), apply_rotary(q, k, cos, sin)):
        assert torch.equal(got, want)
    gate, up = torch.randn(3, 10), torch.randn(3, 10)
    assert torch.equal(cuda_ops.silu_mul_(Unused(), gate, up), silu_mul(gate, up))


def gpu_lib():
    lib = cuda_ops.load_library()
    assert lib is not None, "build/lib/libinflight_ops_cuda.so is missing: run `make native` with nvcc"
    return lib


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows, n", [(1, 4096), (37, 1000), (300, 64)])
def test_add_rms_norm_matches_the_module(dtype, rows, n):
    torch.manual_seed(rows)
    norm = RMSNorm(n, 1e-5).to("cuda", dtype)
    norm.weight.data.normal_()
    fused = cuda_ops.CudaRMSNorm(norm, gpu_lib())
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    residual = torch.randn(rows, n, device="cuda", dtype=dtype)
    want, want_residual = norm(x, residual)
    got_residual = residual.clone()
    got, same = fused(x, got_residual)
    assert same is got_residual and torch.equal(got_residual, want_residual)  # the add, in place, as torch's
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]  # the sum's order differs
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(fused(x), norm(x), rtol=tol, atol=tol)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_apply_rotary_bitwise(dtype, head_dim):
    """q and k as views of a merged qkv projection's rows (one call over both), and apart (a call each)."""
    torch.manual_seed(head_dim)
    tokens, heads, kv_heads = 29, 8, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    angles = torch.rand(tokens, 1, head_dim, device="cuda") * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    views = lambda t: (t[:, :heads * head_dim].view(tokens, heads, head_dim),  # noqa: E731
                       t[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim))
    want_q, want_k = apply_rotary(*views(qkv), cos, sin)
    fused = qkv.clone()
    got_q, got_k = cuda_ops._rotary_pair(gpu_lib(), *views(fused), cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(fused[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v kept
    q, k = (t.contiguous() for t in views(qkv))
    got_q, got_k = cuda_ops._rotary_pair(gpu_lib(), q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 45])
def test_silu_mul_matches_the_module_bitwise(dtype, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1376, device="cuda", dtype=dtype) * 4
    gate, up = gate_up[:, :1376], gate_up[:, 1376:]
    assert torch.equal(cuda_ops.silu_mul_(gpu_lib(), gate, up), silu_mul(gate, up))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_engine_tokens_are_the_same_with_the_fused_ops(tiny_model, graphs):
    def run(fused: str) -> dict[str, list[int]]:
        engine = InflightEngine(EngineConfig(checkpoint=tiny_model, device="cuda", dtype="float32",
                                             num_kv_blocks=256, max_batch_size=8, cuda_graphs=graphs,
                                             cuda_fused_ops=fused))
        assert ("fused CUDA ops" in engine.runner.describe()) == (fused == "on")
        out = {}
        for i, prompt in enumerate(([1, 5, 9, 2], [7] * 40, [3, 4], list(range(3, 90)))):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, min_tokens=24))
            out[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None, o.error
                out[o.req_id] += o.token_ids
        return out

    assert run("on") == run("off")
