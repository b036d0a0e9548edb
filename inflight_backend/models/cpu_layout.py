"""CPU weight layouts for the model's linear layers, chosen once at load time (`linear_backend`).

- `native`: PackedLinear, fp32 weights packed into the column panels of the skinny GEMM in plugins/linear
  (libinflight_sgemm_cpu.so), with each layer's q/k/v and gate/up projections merged into one GEMM each. It
  streams each panel once per call; for the 1..32 rows of a decode step it runs up to 1.5x faster than MKL,
  which repacks the weight on every call, and within 10-25% of MKL for prefill-sized inputs
  (benchmarks/skinny_gemm.py).
- `torch`: InputMajorLinear, the weight stored transposed, (in, out) contiguous: MKL's GEMM for few rows runs
  up to 2x faster with that layout than with nn.Linear's (out, in).
`auto` picks native for fp32 when the library is built with AVX-512 or AVX2+FMA, else torch. CUDA models keep nn.Linear.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR_BACKENDS
from . import skinny_gemm
from .activation_pool import ActivationPool


class InputMajorLinear(nn.Module):
    """y = x @ weight_t + bias, with weight_t = linear.weight.T stored contiguously."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight_t).view(*x.shape[:-1], -1)


class PackedLinear(nn.Module):
    """y = x @ W^T + bias through the native skinny GEMM; fp32 only, one packed copy of the weight. Large outputs
    go in buffers of `pool` (shared by a model's layers) that nothing holds any more."""

    def __init__(self, linear: nn.Linear, lib, pool: ActivationPool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_t = linear.weight.detach().float().t().contiguous()
        self.packed = nn.Parameter(skinny_gemm.pack(lib, weight_t), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().contiguous(),
                                                                 requires_grad=False)
        self._lib = lib
        self._pool = pool or ActivationPool()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = skinny_gemm.gemm(self._lib, rows, self.packed, self.out_features, self.bias,
                             self._pool.take(rows.shape[0], self.out_features))
        return y.view(*x.shape[:-1], self.out_features)


def resolve(backend: str, dtype: torch.dtype):
    """The skinny-GEMM library when `backend` asks for (or `auto` can use) it, else None."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    lib = skinny_gemm.load_library() if dtype == torch.float32 else None
    if lib is None and backend == "native":
        raise RuntimeError("linear_backend: native needs fp32 and build/lib/libinflight_sgemm_cpu.so built with "
                           "AVX-512 or AVX2+FMA (`make native` on such a machine); use auto or torch")
    return lib


def convert_cpu_linears(model: nn.Module, backend: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    """Replace every nn.Linear in `model` (in place) by the chosen CPU layout; returns its name.
    Tied weights get their own copy. The native layout first merges the projections of modules that offer it
    (`merge_projections`, models/llama.py)."""
    lib = resolve(backend, dtype)
    if lib is None:
        _replace(model, InputMajorLinear)
        return "torch (input-major)"
    # The skinny GEMM computes each output column alone, in the same order whatever the other columns, so
    # merged q/k/v and gate/up projections give exactly the separate ones' results, in fewer calls.
    for module in model.modules():
        if callable(merge := getattr(module, "merge_projections", None)):
            merge()
    pool = ActivationPool()
    _replace(model, lambda linear: PackedLinear(linear, lib, pool))
    return "native skinny GEMM (packed, merged qkv and gate/up)"


def _replace(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _replace(child, make)
