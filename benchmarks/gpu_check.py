"""The prepared check for a session that has a GPU (run by benchmarks/gpu_check.sh).

CUDA kernels against the fp32 torch reference on every random batch the CPU tests use (fp32, bf16, fp16; head
sizes 64 and 128; block sizes 1..128; GQA 1..8; multi-token causal queries; contexts to 2048), sliding windows
(1..4096 tokens) on a fused step and on decodes, the KV write against the reference's; then
benchmarks/attention.py --device cuda prints decode timings. `--ops`: instead, the fused ops of plugins/cuda_ops
against the torch modules they replace (`cuda_fused_ops`; a stage of its own, so that their failure does not take
the attention kernels out of the engine's check).
Needs only torch with CUDA and the built library (no other package of the project's).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.attention import NativePagedAttention, TorchPagedAttention, load_library  # noqa: E402
from inflight_backend.attention.random_batch import (CASES, TOLERANCE, WINDOW_STEP, WINDOWS, max_error,  # noqa: E402
                                                     random_batch, window_error)


def check_attention(lib) -> bool:
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_size in (64, 128):
            worst = 0.0
            for case in CASES:
                backend = NativePagedAttention(lib, "cuda")
                err = max_error(backend, dtype, "cuda", head_size, case, seed=7)
                worst = max(worst, err)
                if err > TOLERANCE[dtype] or backend._use_fallback:
                    ok = False
                    print(f"FAIL attention {dtype} head {head_size} case {case}: max error {err:.3g}")
            print(f"attention {str(dtype):15s} head {head_size:3d}: worst max error {worst:.3g} "
                  f"(tolerance {TOLERANCE[dtype]:g}) over {len(CASES)} cases")
    return ok


def check_windows(lib) -> bool:
    ok, worst = True, {}
    decodes = [(c, 1) for c in (1, 7, 8, 17, 100, 515, 2000, 33)]
    for dtype in (torch.float32, torch.bfloat16):
        for window in WINDOWS:
            for name, lengths in (("fused", WINDOW_STEP), ("decodes", decodes)):
                err = window_error(NativePagedAttention(lib, "cuda"), dtype, "cuda", 128, window, 16, seed=window,
                                   lengths=lengths)
                worst[dtype] = max(worst.get(dtype, 0.0), err)
                if err > TOLERANCE[dtype]:
                    ok = False
                    print(f"FAIL sliding window {window} {name} {dtype}: max error {err:.3g}")
        print(f"sliding windows {str(dtype):15s}: worst max error {worst[dtype]:.3g} over {len(WINDOWS)} windows")
    return ok


def check_write_kv(lib) -> bool:
    q, k_cache, v_cache, meta = random_batch(random.Random(0), num_seqs=3, block_size=16, num_heads=8,
                                             num_kv_heads=2, head_size=128, max_context=200, max_query=9,
                                             dtype=torch.bfloat16, device="cuda")
    num_tokens = q.shape[0]
    slots = random.Random(1).sample(range(k_cache.shape[0] * 16), num_tokens)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device="cuda")
    k, v = (torch.randn(num_tokens, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    TorchPagedAttention().write_kv(k_ref, v_ref, k, v, meta)
    NativePagedAttention(lib, "cuda").write_kv(k_cache, v_cache, k, v, meta)
    torch.cuda.synchronize()
    ok = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    print(f"write_kv bf16: {'identical to the reference' if ok else 'FAIL: differs from the reference'}")
    return ok


def check_fused_ops() -> bool:
    """Rotary and SiLU-and-multiply bitwise equal to torch's modules; the residual add too, and the RMSNorm
    within its sum's reordering (tests/test_cuda_ops.py has the same checks, for pytest)."""
    from inflight_backend.models import cuda_ops
    from inflight_backend.models.llama import RMSNorm, apply_rotary, silu_mul

    lib = cuda_ops.load_library()
    if lib is None:
        print("FAIL fused ops: build/lib/libinflight_ops_cuda.so missing")
        return False
    ok = True
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)):
        torch.manual_seed(0)
        norm = RMSNorm(4096, 1e-5).to("cuda", dtype)
        norm.weight.data.normal_()
        x, residual = (torch.randn(37, 4096, device="cuda", dtype=dtype) for _ in range(2))
        want, want_residual = norm(x, residual)
        got_residual = residual.clone()
        got, _ = cuda_ops.CudaRMSNorm(norm, lib)(x, got_residual)
        norm_err = (got.float() - want.float()).abs().max().item()
        qkv = torch.randn(29, 12 * 128, device="cuda", dtype=dtype)
        angles = torch.rand(29, 1, 128, device="cuda") * 100
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        q, k = qkv[:, :8 * 128].view(29, 8, 128), qkv[:, 8 * 128:10 * 128].view(29, 2, 128)
        want_q, want_k = apply_rotary(q, k, cos, sin)
        got_q, got_k = cuda_ops._rotary_pair(lib, q, k, cos, sin)
        gate_up = torch.randn(45, 2 * 1376, device="cuda", dtype=dtype) * 4
        silu_same = torch.equal(cuda_ops.silu_mul_(lib, gate_up[:, :1376], gate_up[:, 1376:]),
                                silu_mul(gate_up[:, :1376], gate_up[:, 1376:]))
        checks = {"residual add identical": torch.equal(got_residual, want_residual),
                  f"RMSNorm max error {norm_err:.3g} <= {tol:g}": norm_err <= tol,
                  "rotary identical": torch.equal(got_q, want_q) and torch.equal(got_k, want_k),
                  "SiLU-and-multiply identical": silu_same}
        print(f"fused ops {str(dtype):15s}: " + ", ".join(("" if v else "FAIL ") + k for k, v in checks.items()))
        ok &= all(checks.values())
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    lib = load_library("cuda")
    if lib is None:
        print("build/lib/libinflight_pa_cuda.so missing: build with cmake first")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--ops" in sys.argv[1:]:
        ok = check_fused_ops()
    else:
        ok = check_write_kv(lib) & check_attention(lib) & check_windows(lib)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
