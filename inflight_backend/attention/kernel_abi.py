"""The C ABI of the paged-attention kernels (plugins/paged_attention/include/paged_attention.h), once: the
parameter struct, the dtype enum and its element sizes, the status codes, the libraries and their calls.

Both callers go through here: the engine's attention backend (attention/native.py, torch tensors) and the
TensorRT plugin (tensorrt/kernel_args.py, raw buffers). The calls take addresses as ints; 0 is a null stream
or workspace.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from ..paths import LIB_DIR

# pa_dtype: each caller maps its framework's types onto these.
PA_FLOAT32, PA_BFLOAT16, PA_FLOAT16 = 0, 1, 2
ITEMSIZE = {PA_FLOAT32: 4, PA_BFLOAT16: 2, PA_FLOAT16: 2}
PA_OK, PA_ERR_DTYPE, PA_ERR_SHAPE = 0, 1, 2


class PaParams(ctypes.Structure):
    """Mirror of `pa_params`: sizes, element strides, dtype, sliding window (0: none)."""

    _fields_ = [(name, ctypes.c_int32) for name in (  # type: ignore[assignment]  # (mixed field types)
        "num_seqs", "num_tokens", "num_heads", "num_kv_heads", "head_size", "block_size", "max_blocks_per_seq",
        "max_context_len")] + [("scale", ctypes.c_float), ("dtype", ctypes.c_int32),
                               ("sliding_window", ctypes.c_int32), ("reserved", ctypes.c_int32)] + [
        (name, ctypes.c_int64) for name in (
            "q_stride_token", "q_stride_head", "out_stride_token", "out_stride_head", "kv_stride_block",
            "kv_stride_token", "kv_stride_head")]


def library_path(device_type: str) -> Path:
    return LIB_DIR / ("libinflight_pa_cuda.so" if device_type == "cuda" else "libinflight_pa_cpu.so")


def load_library(device_type: str, path: Path | None = None) -> ctypes.CDLL | None:
    """The kernel library for `device_type` ('cpu' or 'cuda'), or None when it has not been built; `path`: another
    build of it (a benchmark's baseline)."""
    path = path or library_path(device_type)
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    prefix = "pa_cuda_" if device_type == "cuda" else "pa_cpu_"
    for name in ("attention", "write_kv"):
        getattr(lib, prefix + name).restype = ctypes.c_int
    if device_type == "cuda":
        lib.pa_cuda_workspace_size.restype = ctypes.c_size_t
    return lib


_ptr = ctypes.c_void_p


def write_kv(lib, cuda: bool, p: PaParams, k: int, v: int, stride_token: int, stride_head: int, slot_mapping: int,
             k_cache: int, v_cache: int, stream: int = 0) -> int:
    """Write each new token's K and V (element strides `stride_token`, `stride_head`) into its slot."""
    args = (ctypes.byref(p), _ptr(k), _ptr(v), ctypes.c_int64(stride_token), ctypes.c_int64(stride_head),
            _ptr(slot_mapping), _ptr(k_cache), _ptr(v_cache))
    return lib.pa_cuda_write_kv(*args, _ptr(stream)) if cuda else lib.pa_cpu_write_kv(*args)


def attention(lib, cuda: bool, p: PaParams, q: int, k_cache: int, v_cache: int, block_tables: int,
              context_lens: int, query_start_loc: int, out: int, workspace: int = 0, workspace_size: int = 0,
              stream: int = 0) -> int:
    """Attend every query token to its sequence's cached context (CUDA: within `workspace`)."""
    args = (ctypes.byref(p), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens),
            _ptr(query_start_loc), _ptr(out))
    if cuda:
        return lib.pa_cuda_attention(*args, _ptr(workspace), ctypes.c_size_t(workspace_size), _ptr(stream))
    return lib.pa_cpu_attention(*args)


def workspace_size(lib, p: PaParams) -> int:
    """Bytes of CUDA workspace `attention` needs for these parameters."""
    return int(lib.pa_cuda_workspace_size(ctypes.byref(p)))
