"""The fused CPU ops of plugins/cpu_ops (RMSNorm, rotary, SiLU-and-multiply, row argmax, the sampler's draw and
log-probabilities), through their C ABI.

Each replaces several small torch ops, and their per-op dispatch, with one pass over memory: at decode-step
sizes those ops cost about as much as their arithmetic. CPU, contiguous rows; the model's ops (RMSNorm, rotary,
SiLU-and-multiply) in fp32 or bf16 (rounded where torch's bf16 ops round), the sampler's in fp32; callers keep the
torch version for anything else.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache, partial

import numpy as np
import torch
from torch import nn

from ..paths import LIB_DIR
from .llama import RMSNorm, install_fused_ops, qk_rows

OPS_OK = 0
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The ops library, or None when it has not been built."""
    path = LIB_DIR / "libinflight_ops_cpu.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    signatures = {
        "ops_rms_norm_f32": [_PTR, _I64, _I64, _I64, _PTR, _F32, _PTR],
        "ops_add_rms_norm_f32": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _F32, _PTR],
        "ops_rotary_f32": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR],
        "ops_silu_mul_f32": [_PTR, _PTR, _I64, _I64, _I64, _PTR],
        "ops_argmax_rows_f32": [_PTR, _I64, _I64, _I64, _PTR],
        "ops_sample_rows_f32": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
        "ops_logprobs_rows_f32": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR],
        "ops_rms_norm_bf16": [_PTR, _I64, _I64, _I64, _PTR, _F32, _PTR],
        "ops_add_rms_norm_bf16": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _F32, _PTR],
        "ops_rotary_bf16": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR],
        "ops_silu_mul_bf16": [_PTR, _PTR, _I64, _I64, _I64, _PTR],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels take `t` as it is: fp32 on the CPU with unit stride along its last dimension."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1


def _check(status: int, name: str) -> None:
    if status != OPS_OK:
        raise RuntimeError(f"{name} failed with status {status}")


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _op(lib: ctypes.CDLL, name: str, t: torch.Tensor):
    """The library's `name` for t's dtype (ops_<name>_f32 or _bf16)."""
    return getattr(lib, f"ops_{name}_{_SUFFIX[t.dtype]}")


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension; x (..., n) with rows at a fixed stride."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype)
    _check(_op(lib, "rms_norm", x)(rows.data_ptr(), rows.shape[0], n, rows.stride(0), weight.data_ptr(), eps,
                                   y.data_ptr()), "rms_norm")
    return y.view(x.shape)


def add_rms_norm_(lib: ctypes.CDLL, residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += h in place, then (rms_norm(residual), residual): RMSNorm's residual form in one pass.
    residual, h: (rows, n) with unit column stride; residual is written."""
    rows, n = residual.shape
    if h.shape != residual.shape or h.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("add_rms_norm_: residual and h must be (rows, n) of one shape with unit column stride")
    y = torch.empty(rows, n, dtype=residual.dtype)
    _check(_op(lib, "add_rms_norm", residual)(residual.data_ptr(), h.data_ptr(), rows, n, residual.stride(0),
                                              h.stride(0), weight.data_ptr(), eps, y.data_ptr()), "add_rms_norm")
    return y, residual


def rotary_(lib: ctypes.CDLL, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding in place. v: (T, heads, D) with contiguous heads; cos, sin: (T, 1, D)
    contiguous (Rotary.tables)."""
    tokens, heads, dim = v.shape
    if v.stride(2) != 1 or v.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_: each token's heads and the cos/sin tables must be contiguous")
    _check(_op(lib, "rotary", v)(v.data_ptr(), tokens, heads, dim, v.stride(0), cos.data_ptr(), sin.data_ptr()),
           "rotary")
    return v


def silu_mul(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise, gate and up of one shape: rows sharing one row stride, as the two halves
    of a merged gate/up projection's output, or any tensors (copied to contiguous first)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1 or u.stride(-1) != 1 or g.stride(0) != u.stride(0):
        g, u = g.contiguous(), u.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype)
    _check(_op(lib, "silu_mul", gate)(g.data_ptr(), u.data_ptr(), g.shape[0], n,
                                      g.stride(0) if g.shape[0] > 1 else n, out.data_ptr()), "silu_mul")
    return out


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() for a 2-D x with unit column stride."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _check(lib.ops_argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr()), "argmax")
    return out.tolist()


def sample_rows(lib: ctypes.CDLL, x: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                top_p: list[float], uniform: list[float], min_p: list[float] | None = None) -> list[int]:
    """One token for each of `rows` of a 2-D x with unit column stride (ops_sample_rows_f32 in
    include/cpu_ops.h: temperature, min-p, top-k, top-p, then the first index whose running mass passes
    uniform[j] of the kept total); -1 for a row with nothing to sample from."""
    arrays = (np.asarray(rows, dtype=np.int64), np.asarray(temperature, dtype=np.float32),
              np.asarray(top_k, dtype=np.int64), np.asarray(top_p, dtype=np.float32),
              np.asarray(min_p if min_p is not None else [0.0] * len(rows), dtype=np.float32),
              np.asarray(uniform, dtype=np.float64))
    out = np.empty(len(rows), dtype=np.int64)
    _check(lib.ops_sample_rows_f32(x.data_ptr(), x.shape[1], x.stride(0), arrays[0].ctypes.data, len(rows),
                                   *(a.ctypes.data for a in arrays[1:]), out.ctypes.data), "sample_rows")
    return out.tolist()


def logprobs_rows(lib: ctypes.CDLL, x: torch.Tensor, rows: list[int], tokens: list[int], top: list[int]
                  ) -> list[tuple[float, tuple[tuple[int, float], ...]] | None]:
    """For each of `rows` of a 2-D x with unit column stride (ops_logprobs_rows_f32): the log-probability of
    tokens[j] and the top[j] most likely (token, log-probability), best first; None for a row holding NaN or
    +inf."""
    count, most = len(tokens), max(top, default=0)
    logprob, ok = np.empty(count, dtype=np.float32), np.empty(count, dtype=np.int32)
    top_ids, top_values = np.empty((count, most), dtype=np.int64), np.empty((count, most), dtype=np.float32)
    where, ids, ks = (np.asarray(a, dtype=np.int64) for a in (rows, tokens, top))
    _check(lib.ops_logprobs_rows_f32(x.data_ptr(), x.shape[1], x.stride(0), where.ctypes.data, count,
                                     ids.ctypes.data, ks.ctypes.data, most, logprob.ctypes.data,
                                     top_ids.ctypes.data, top_values.ctypes.data, ok.ctypes.data), "logprobs_rows")
    return [(float(logprob[j]), tuple(zip(top_ids[j, :top[j]].tolist(), top_values[j, :top[j]].tolist())))
            if ok[j] else None for j in range(count)]


class NativeRMSNorm(nn.Module):
    """RMSNorm through ops_rms_norm_f32 or _bf16, the model's dtype (same weight, same eps)."""

    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self._lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm.forward; with `residual`, the add happens in place in `residual`."""
        if residual is None:
            return rms_norm(self._lib, x, self.weight, self.eps)
        return add_rms_norm_(self._lib, residual, x, self.weight, self.eps)


def _rotary_pair(lib, q, k, cos, sin):
    """Rotary on q and k; one call when k's heads follow q's in each row (a merged qkv projection's output)."""
    if (qk := qk_rows(q, k)) is not None:
        rotary_(lib, qk, cos, sin)
        return q, k
    return rotary_(lib, q, cos, sin), rotary_(lib, k, cos, sin)


def convert_cpu_ops(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Fuse the model's RMSNorms, rotary embeddings and SiLU-and-multiply (in place). Only for an fp32 or bf16
    model on the CPU whose linear layers return contiguous rows (PackedLinear, PackedBf16Linear): the kernels
    take those tensors as they come, with no per-call checks."""
    install_fused_ops(model, partial(_rotary_pair, lib), partial(silu_mul, lib), lambda norm: NativeRMSNorm(norm, lib))
