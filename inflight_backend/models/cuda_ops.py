"""The fused CUDA ops of plugins/cuda_ops (the residual add with RMSNorm, rotary, SiLU-and-multiply), through
their C ABI (`cuda_fused_ops`).

On a GPU each replaces 3-8 small torch kernels with one pass over memory: at a large decode batch those kernels
took about a sixth of a step. They round to the dtype wherever torch's modules do (include/cuda_ops.h), launch
on torch's current stream (so CUDA graphs capture them), and take tensors as the model's modules produce them;
anything else (another layout, a CPU tensor) goes through the torch module they replace.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache, partial

import torch
from torch import nn

from ..paths import LIB_DIR
from .llama import RMSNorm, apply_rotary, install_fused_ops, qk_rows, silu_mul

COPS_OK = 0
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The CUDA ops library, or None when it has not been built (no nvcc at build time)."""
    path = LIB_DIR / "libinflight_ops_cuda.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    signatures = {
        "cops_add_rms_norm": [_INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _F32, _PTR, _PTR],
        "cops_rotary": [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR],
        "cops_silu_mul": [_INT, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _check(status: int, name: str) -> None:
    if status != COPS_OK:
        raise RuntimeError(f"{name} failed with status {status}")


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _rows(t: torch.Tensor, n: int) -> bool:
    """Whether `t` is a CUDA (rows, n) matrix of a supported dtype with contiguous rows."""
    return t.is_cuda and t.dtype in DTYPES and t.dim() == 2 and t.shape[1] == n and t.stride(1) == 1


def add_rms_norm_(lib: ctypes.CDLL, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """RMSNorm of residual + h, that sum written into `residual` (rows, n); with h None, of residual alone."""
    rows, n = residual.shape
    y = torch.empty(rows, n, dtype=residual.dtype, device=residual.device)
    _check(lib.cops_add_rms_norm(DTYPES[residual.dtype], residual.data_ptr(), None if h is None else h.data_ptr(),
                                 rows, n, residual.stride(0), n if h is None else h.stride(0), weight.data_ptr(),
                                 eps, y.data_ptr(), _stream()), "add_rms_norm")
    return y


class CudaRMSNorm(RMSNorm):
    """RMSNorm through cops_add_rms_norm (the same weight and eps); with `residual`, the add happens in place."""

    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL) -> None:
        nn.Module.__init__(self)  # not RMSNorm's: the norm's own weight, not a new one
        self.weight, self.eps, self._lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        n = x.shape[-1]
        fits = (_rows(x, n) and self.weight.dtype == x.dtype and self.weight.is_contiguous()
                and (residual is None or (_rows(residual, n) and residual.dtype == x.dtype
                                          and residual.shape == x.shape)))
        if not fits:
            return super().forward(x, residual)
        if residual is None:
            return add_rms_norm_(self._lib, x, None, self.weight, self.eps)
        return add_rms_norm_(self._lib, residual, x, self.weight, self.eps), residual


def rotary_(lib: ctypes.CDLL, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding in place. v: (T, heads, D), heads contiguous; cos, sin: (T, 1, D)."""
    tokens, heads, dim = v.shape
    _check(lib.cops_rotary(DTYPES[v.dtype], v.data_ptr(), tokens, heads, dim, v.stride(0), cos.data_ptr(),
                           sin.data_ptr(), _stream()), "rotary")
    return v


def _rotary_fits(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    tokens, heads, dim = v.shape
    return (v.is_cuda and v.dtype in DTYPES and v.stride(2) == 1 and v.stride(1) == dim and dim % 2 == 0
            and cos.dtype == sin.dtype == v.dtype and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == sin.numel() == tokens * dim)


def _rotary_pair(lib, q, k, cos, sin):
    """Rotary on q and k in place; one call when k's heads follow q's in each row (a merged qkv projection)."""
    if (qk := qk_rows(q, k)) is not None and _rotary_fits(qk, cos, sin):
        rotary_(lib, qk, cos, sin)
        return q, k
    if _rotary_fits(q, cos, sin) and _rotary_fits(k, cos, sin):
        return rotary_(lib, q, cos, sin), rotary_(lib, k, cos, sin)
    return apply_rotary(q, k, cos, sin)


def silu_mul_(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape whose rows share a stride (the two halves of a merged
    gate/up projection's output); other layouts through torch."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if not (gate.shape == up.shape and _rows(g, n) and _rows(u, n) and u.dtype == g.dtype
            and g.stride(0) == u.stride(0)):
        return silu_mul(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _check(lib.cops_silu_mul(DTYPES[g.dtype], g.data_ptr(), u.data_ptr(), g.shape[0], n,
                             g.stride(0) if g.shape[0] > 1 else n, out.data_ptr(), _stream()), "silu_mul")
    return out


def convert_cuda_ops(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Fuse the model's RMSNorms, rotary embeddings and SiLU-and-multiply (in place)."""
    install_fused_ops(model, partial(_rotary_pair, lib), partial(silu_mul_, lib), lambda norm: CudaRMSNorm(norm, lib))
