"""CPU weight layouts for the model's linear layers, chosen once at load time (`linear_backend`).

- `native`: PackedLinear, fp32 weights packed into the column panels of the skinny GEMM in plugins/linear
  (libinflight_sgemm_cpu.so), with each layer's q/k/v and gate/up projections merged into one GEMM each. It
  streams each panel once per call; for the 1..32 rows of a decode step it runs up to 1.5x faster than MKL,
  which repacks the weight on every call, and within 10-25% of MKL for prefill-sized inputs
  (benchmarks/skinny_gemm.py).
- `torch`: InputMajorLinear, the weight stored transposed, (in, out) contiguous: MKL's GEMM for few rows runs
  up to 2x faster with that layout than with nn.Linear's (out, in).
- `native` for a bfloat16 model: PackedBf16Linear, the weights packed once into bf16 panels and multiplied by
  AVX512-BF16 dot products (plugins/linear/include/bf16_gemm.h), bf16 in and out, each output summed in fp32 and
  rounded once as torch's GEMM rounds it; with weights read from memory 2.2-4.3x faster than torch's bf16 GEMM
  (oneDNN, which reorders the weight on every call) at 1-8 rows, 1.7-2.2x at 32, as fast from 256 rows.
`auto` picks native for fp32 when the library is built with AVX-512 or AVX2+FMA and for bf16 on processors with
AVX512-BF16 but no AMX (with AMX, oneDNN's bf16 GEMM multiplies prefill-sized inputs on AMX tiles; ours is not
measured against it), else torch. CUDA models keep nn.Linear.

With the native layout on a processor with AMX (`amx_gemm`), each layer's weights are also packed as three bf16
pieces (amx_gemm.h), and inputs of at least `skinny_gemm.amx_min_rows` rows (prefill steps) multiply through AMX
tiles at fp32 accuracy, 1.3-1.7x faster than the skinny GEMM there; 6 more bytes of memory per weight. The LM
head keeps one copy: it only sees a step's sampled rows, one per sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import AMX_GEMM, LINEAR_BACKENDS
from . import skinny_gemm
from .activation_pool import ActivationPool
from .llama import merge_projections


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
    """y = x @ W^T + bias through the native skinny GEMM; fp32 only, one packed copy of the weight, and with
    `amx` its AMX form too, used from `amx_min_rows` rows on. Large outputs go in buffers of `pool` (shared by a
    model's layers) that nothing holds any more."""

    def __init__(self, linear: nn.Linear, lib, pool: ActivationPool | None = None, amx: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_t = linear.weight.detach().float().t()  # a view: packed in place (a real LM head's copy is GBs)
        self.packed = nn.Parameter(skinny_gemm.pack(lib, weight_t), requires_grad=False)
        self.amx_packed = (nn.Parameter(skinny_gemm.amx_pack(lib, weight_t.contiguous()), requires_grad=False)
                           if amx else None)
        self.amx_min_rows = skinny_gemm.amx_min_rows(lib)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().contiguous(),
                                                                 requires_grad=False)
        self._lib = lib
        self._pool = pool or ActivationPool()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self._pool.take(rows.shape[0], self.out_features)
        if self.amx_packed is not None and rows.shape[0] >= self.amx_min_rows:
            y = skinny_gemm.amx_gemm(self._lib, rows, self.amx_packed, self.out_features, self.bias, out)
        else:
            y = skinny_gemm.gemm(self._lib, rows, self.packed, self.out_features, self.bias, out)
        return y.view(*x.shape[:-1], self.out_features)


class PackedBf16Linear(nn.Module):
    """y = x @ W^T + bias for a bfloat16 model through the native bf16 GEMM: one packed copy of the weight, x and
    y in bf16, the bias kept in fp32 (added to the fp32 sums before they are rounded)."""

    def __init__(self, linear: nn.Linear, lib) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_t = linear.weight.detach().t()  # a view: packed in place
        self.packed = nn.Parameter(skinny_gemm.bf16_pack(lib, weight_t), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().contiguous(),
                                                                 requires_grad=False)
        self._lib = lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = skinny_gemm.bf16_gemm(self._lib, rows, self.packed, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def resolve(backend: str, dtype: torch.dtype):
    """The skinny-GEMM library when `backend` asks for (or `auto` can use) it, else None."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    lib = skinny_gemm.load_library() if dtype in (torch.float32, torch.bfloat16) else None
    if dtype == torch.bfloat16 and not skinny_gemm.bf16_available(lib):
        lib = None
    if dtype == torch.bfloat16 and backend == "auto" and lib is not None and skinny_gemm.amx_available(lib):
        # oneDNN multiplies prefill-sized bf16 inputs on AMX tiles, which the bf16 GEMM does not: not measured
        # against it yet (no AMX machine), so `auto` keeps torch's there; `native` still chooses ours.
        lib = None
    if lib is None and backend == "native":
        raise RuntimeError("linear_backend: native needs build/lib/libinflight_sgemm_cpu.so (`make native`) and fp32 "
                           "on a processor with AVX-512 or AVX2+FMA, or bfloat16 on one with AVX512-BF16; use auto "
                           "or torch")
    return lib


def resolve_amx(lib, amx_gemm: str) -> bool:
    """Whether the native layout (`lib`, None for torch's) also packs weights for AMX, as `amx_gemm` asks."""
    if amx_gemm not in AMX_GEMM:
        raise ValueError(f"amx_gemm must be one of {AMX_GEMM}, got {amx_gemm!r}")
    usable = lib is not None and skinny_gemm.amx_available(lib)
    if amx_gemm == "on" and not usable:
        raise RuntimeError("amx_gemm: on needs the native linear layout (fp32) and a processor with AMX-BF16 whose "
                           "kernel grants the tile state (Linux 5.16+); use auto or off")
    return usable and amx_gemm != "off"


def convert_cpu_linears(model: nn.Module, backend: str = "auto", dtype: torch.dtype = torch.float32,
                        amx_gemm: str = "auto") -> str:
    """Replace every nn.Linear in `model` (in place) by the chosen CPU layout; returns its name.
    Tied weights get their own copy. The native layout first merges the projections of modules that offer it
    (`merge_projections`, models/llama.py)."""
    lib = resolve(backend, dtype)
    amx = resolve_amx(lib if dtype == torch.float32 else None, amx_gemm)
    if lib is None:
        _replace(model, lambda name, linear: InputMajorLinear(linear))
        return "torch (input-major)"
    # The native GEMMs compute each output column alone, in the same order whatever the other columns, so
    # merged q/k/v and gate/up projections give exactly the separate ones' results, in fewer calls.
    merge_projections(model)
    if dtype == torch.bfloat16:
        _replace(model, lambda name, linear: PackedBf16Linear(linear, lib))
        return "native bf16 GEMM (AVX512-BF16, packed, merged qkv and gate/up)"
    pool = ActivationPool()
    _replace(model, lambda name, linear: PackedLinear(linear, lib, pool, amx and name != "lm_head"))
    amx_rows = skinny_gemm.amx_min_rows(lib)
    return ("native skinny GEMM (packed, merged qkv and gate/up)"
            + (f", AMX bf16x6 from {amx_rows} rows" if amx else ""))


def _replace(module: nn.Module, make) -> None:
    """Every nn.Linear below `module` -> make(its attribute name, it)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(name, child))
        else:
            _replace(child, make)
