"""The native GEMMs of plugins/linear, through their C ABI: the skinny GEMM (weights packed once into fp32
column panels, y = x @ W (+ bias) for any number of rows, fastest against torch's GEMM at decode-step sizes)
and, on processors with AMX, the bf16x6 GEMM for prefill-sized inputs (amx_gemm.h: fp32 accuracy from six bf16
tile products per value); for bfloat16 models, on processors with AVX512-BF16, the bf16 GEMM (bf16_gemm.h)."""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from ..paths import LIB_DIR

SG_OK = 0
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@lru_cache(maxsize=2)
def load_library(path: Path | None = None) -> ctypes.CDLL | None:
    """The kernel library (`path`: another build of it, e.g. an older commit's, for benchmarks), or None when it
    has not been built or was built without AVX-512 or AVX2+FMA."""
    path = path or LIB_DIR / "libinflight_sgemm_cpu.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.sg_packed_size.restype = _I64
    lib.sg_packed_size.argtypes = [_I64, _I64]
    lib.sg_pack_f32.restype = ctypes.c_int
    lib.sg_pack_f32.argtypes = [_PTR, _I64, _I64, _PTR]
    if hasattr(lib, "sg_pack_f32_strided"):  # (older builds, a benchmark's --baseline-lib, pack contiguous ones)
        lib.sg_pack_f32_strided.restype = ctypes.c_int
        lib.sg_pack_f32_strided.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR]
    lib.sg_gemm_f32.restype = ctypes.c_int
    lib.sg_gemm_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    if hasattr(lib, "sg_chunk_rows"):  # builds before it (a benchmark's --baseline-lib) choose no chunk size
        lib.sg_chunk_rows.restype = _I64
        lib.sg_chunk_rows.argtypes = [_I64]
    if hasattr(lib, "sg_stream_ahead"):
        lib.sg_stream_ahead.restype = _I64
        lib.sg_stream_ahead.argtypes = [_I64]
    if hasattr(lib, "sg_bf16_gemm"):
        lib.sg_bf16_available.restype = ctypes.c_int
        lib.sg_bf16_packed_size.restype = _I64
        lib.sg_bf16_packed_size.argtypes = [_I64, _I64]
        lib.sg_bf16_pack.restype = ctypes.c_int
        lib.sg_bf16_pack.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR]
        lib.sg_bf16_gemm.restype = ctypes.c_int
        lib.sg_bf16_gemm.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    if hasattr(lib, "sg_dot_columns"):  # (builds before the greedy screen have none)
        lib.sg_dot_columns.restype = ctypes.c_int
        lib.sg_dot_columns.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR]
    lib.sg_amx_available.restype = ctypes.c_int
    lib.sg_amx_min_rows.restype = ctypes.c_int
    lib.sg_amx_packed_size.restype = _I64
    lib.sg_amx_packed_size.argtypes = [_I64, _I64]
    lib.sg_amx_pack_f32.restype = ctypes.c_int
    lib.sg_amx_pack_f32.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.sg_amx_gemm_f32.restype = ctypes.c_int
    lib.sg_amx_gemm_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    x, out = torch.ones(1, 1), torch.empty(1)
    packed = pack(lib, x)  # every buffer the call touches stays referenced until it returns
    if lib.sg_gemm_f32(x.data_ptr(), 1, 1, 1, packed.data_ptr(), 1, None, out.data_ptr()) != SG_OK:
        return None  # built for a processor without AVX-512 or AVX2+FMA
    return lib


def pack(lib: ctypes.CDLL, weight_t: torch.Tensor) -> torch.Tensor:
    """weight_t: (K, N) fp32 (input-major), any strides (an nn.Linear's weight.t() is read in place, no copy)
    -> the kernel's packed panels (1-D)."""
    k, n = weight_t.shape
    packed = torch.empty(lib.sg_packed_size(k, n), dtype=torch.float32)
    if hasattr(lib, "sg_pack_f32_strided"):
        status = lib.sg_pack_f32_strided(weight_t.data_ptr(), k, n, weight_t.stride(0), weight_t.stride(1),
                                         packed.data_ptr())
    else:
        weight_t = weight_t.contiguous()
        status = lib.sg_pack_f32(weight_t.data_ptr(), k, n, packed.data_ptr())
    if status != SG_OK:
        raise ValueError(f"cannot pack a weight of shape {tuple(weight_t.shape)}")
    return packed


def gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 with unit column stride -> x @ W + bias, (M, n), into `out` (contiguous (M, n)) if given."""
    return _call(lib.sg_gemm_f32, "skinny GEMM", torch.float32, x, packed, n, bias, out)


def _call(fn, what: str, dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor, n: int,
          bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """One GEMM entry point of the library (its shared signature) on x's rows, into `out` or a new (M, n) tensor."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=dtype) if out is None else out
    status = fn(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                y.data_ptr())
    if status != SG_OK:
        raise RuntimeError(f"{what} failed with status {status}")
    return y


def chunk_rows(lib: ctypes.CDLL, rows: int = 0) -> int:
    """The k rows of a panel each pass of the GEMM walks (chosen from the L1 cache's size when the library
    loads); `rows` > 0 sets it for the calls that follow (tests and benchmarks)."""
    return int(lib.sg_chunk_rows(rows))


def stream_ahead(lib: ctypes.CDLL, num_bytes: int = -1) -> int:
    """How far ahead of its loads (bytes) a GEMM of at most 6 rows fetches the weights, 0 meaning the next chunk as
    with more rows; `num_bytes` >= 0 sets it for the calls that follow (tests and benchmarks)."""
    return int(lib.sg_stream_ahead(num_bytes))


def amx_available(lib: ctypes.CDLL) -> bool:
    """Whether this process can run the AMX GEMM (processor, compiler and kernel all allow it)."""
    return bool(lib.sg_amx_available())


def amx_min_rows(lib: ctypes.CDLL) -> int:
    """Rows from which the AMX GEMM is used instead of the skinny one."""
    return int(lib.sg_amx_min_rows())


def amx_pack(lib: ctypes.CDLL, weight_t: torch.Tensor) -> torch.Tensor:
    """weight_t: (K, N) fp32 contiguous -> its bf16 pieces for the AMX GEMM (1-D int16, 6 bytes a value)."""
    k, n = weight_t.shape
    packed = torch.empty(lib.sg_amx_packed_size(k, n), dtype=torch.int16)
    if lib.sg_amx_pack_f32(weight_t.data_ptr(), k, n, packed.data_ptr()) != SG_OK:
        raise ValueError(f"cannot pack a weight of shape {tuple(weight_t.shape)} for AMX")
    return packed


def amx_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """As `gemm`, through the AMX GEMM on `amx_pack`'s form of the weight."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    status = lib.sg_amx_gemm_f32(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                                 None if bias is None else bias.data_ptr(), y.data_ptr())
    if status != SG_OK:
        raise RuntimeError(f"AMX GEMM failed with status {status}")
    return y


def bf16_available(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` has the bf16 GEMM and this processor runs it (AVX512-BF16)."""
    return lib is not None and hasattr(lib, "sg_bf16_gemm") and bool(lib.sg_bf16_available())


def bf16_pack(lib: ctypes.CDLL, weight_t: torch.Tensor) -> torch.Tensor:
    """weight_t: (K, N) bf16, any strides (an nn.Linear's weight.t() is read in place) -> the bf16 GEMM's panels
    (1-D int16: bf16 bits)."""
    k, n = weight_t.shape
    packed = torch.empty(lib.sg_bf16_packed_size(k, n), dtype=torch.int16)
    if lib.sg_bf16_pack(weight_t.data_ptr(), k, n, weight_t.stride(0), weight_t.stride(1), packed.data_ptr()) != SG_OK:
        raise ValueError(f"cannot pack a weight of shape {tuple(weight_t.shape)}")
    return packed


def bf16_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16 with unit column stride -> x @ W + bias (bias: fp32), (M, n) bf16, into `out` if given."""
    return _call(lib.sg_bf16_gemm, "bf16 GEMM", torch.bfloat16, x, packed, n, bias, out)
