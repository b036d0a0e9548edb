"""The native paged-attention kernels of plugins/paged_attention (CPU and CUDA), called through their C ABI."""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..paths import LIB_DIR
from .base import AttentionBackend, AttentionMetadata
from .torch_ref import TorchPagedAttention

log = logging.getLogger("inflight")

PA_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PA_OK, PA_ERR_DTYPE, PA_ERR_SHAPE = 0, 1, 2


class PaParams(ctypes.Structure):
    """Mirror of `pa_params` in plugins/paged_attention/include/paged_attention.h."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_seqs", "num_tokens", "num_heads", "num_kv_heads", "head_size", "block_size", "max_blocks_per_seq",
        "max_context_len")] + [("scale", ctypes.c_float), ("dtype", ctypes.c_int32),
                               ("sliding_window", ctypes.c_int32), ("reserved", ctypes.c_int32)] + [
        (name, ctypes.c_int64) for name in (
            "q_stride_token", "q_stride_head", "out_stride_token", "out_stride_head", "kv_stride_block",
            "kv_stride_token", "kv_stride_head")]


def library_path(device_type: str) -> Path:
    return LIB_DIR / ("libinflight_pa_cuda.so" if device_type == "cuda" else "libinflight_pa_cpu.so")


def load_library(device_type: str) -> ctypes.CDLL | None:
    """The kernel library for `device_type` ('cpu' or 'cuda'), or None when it has not been built."""
    path = library_path(device_type)
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    prefix = "pa_cuda_" if device_type == "cuda" else "pa_cpu_"
    for name in ("attention", "write_kv"):
        getattr(lib, prefix + name).restype = ctypes.c_int
    if device_type == "cuda":
        lib.pa_cuda_workspace_size.restype = ctypes.c_size_t
    return lib


def make_params(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor, window: int = 0) -> PaParams:
    """Describe tensors to the kernels: sizes, element strides, dtype, sliding window (0: none)."""
    num_tokens, num_heads, head_size = q.shape
    return PaParams(
        num_seqs=len(meta.context_lens), num_tokens=num_tokens, num_heads=num_heads,
        num_kv_heads=k_cache.shape[2], head_size=head_size, block_size=k_cache.shape[1],
        max_blocks_per_seq=meta.block_tables.shape[1], max_context_len=meta.max_context_len, scale=scale,
        dtype=PA_DTYPES[q.dtype], sliding_window=window, q_stride_token=q.stride(0), q_stride_head=q.stride(1),
        out_stride_token=out.stride(0), out_stride_head=out.stride(1), kv_stride_block=k_cache.stride(0),
        kv_stride_token=k_cache.stride(1), kv_stride_head=k_cache.stride(2))


class NativePagedAttention(AttentionBackend):
    """Runs the CPU or CUDA kernel by the device of the tensors; shapes or dtypes a kernel does not support
    (CPU: fp16; CUDA: head sizes other than 64/128) go to the torch reference, with one warning."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, device_type: str) -> None:
        self.lib = lib
        self.cuda = device_type == "cuda"
        self._fallback = TorchPagedAttention()
        self._use_fallback = False
        self._workspace = None
        self._params_meta: AttentionMetadata | None = None  # the step whose kernel parameters are cached
        self._params: dict[tuple, PaParams] = {}

    def write_kv(self, k_cache, v_cache, k, v, meta):
        if self._use_fallback or k.stride() != v.stride():
            return self._fallback.write_kv(k_cache, v_cache, k, v, meta)
        p = self._step_params(k, k_cache, meta, 1.0, k)
        args = [ctypes.byref(p), _ptr(k), _ptr(v), ctypes.c_int64(k.stride(0)), ctypes.c_int64(k.stride(1)),
                _ptr(meta.slot_mapping), _ptr(k_cache), _ptr(v_cache)]
        status = self.lib.pa_cuda_write_kv(*args, _stream()) if self.cuda else self.lib.pa_cpu_write_kv(*args)
        if status in (PA_ERR_DTYPE, PA_ERR_SHAPE):
            self._fall_back(status, k)
            return self._fallback.write_kv(k_cache, v_cache, k, v, meta)
        self._check(status)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        if self._use_fallback:
            return self._fallback.forward(q, k_cache, v_cache, meta, scale, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        p = self._step_params(q, k_cache, meta, scale, out, window)
        args = [ctypes.byref(p), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(meta.block_tables),
                _ptr(meta.context_lens_tensor), _ptr(meta.query_start_loc_tensor), _ptr(out)]
        if self.cuda:
            workspace = self._cuda_workspace(self.lib.pa_cuda_workspace_size(ctypes.byref(p)), q.device)
            status = self.lib.pa_cuda_attention(*args, _ptr(workspace), ctypes.c_size_t(workspace.numel()),
                                                _stream())
        else:
            status = self.lib.pa_cpu_attention(*args)
        if status in (PA_ERR_DTYPE, PA_ERR_SHAPE):
            self._fall_back(status, q)
            return self._fallback.forward(q, k_cache, v_cache, meta, scale, window)
        self._check(status)
        return out

    def _step_params(self, q, k_cache, meta, scale, out, window=0) -> PaParams:
        """make_params, built once per step and shape: every layer of a step passes the same metadata and
        tensors of the same shapes and strides."""
        if meta is not self._params_meta:
            self._params_meta, self._params = meta, {}
        key = (q.shape, q.stride(), q.dtype, out.stride(), k_cache.shape, k_cache.stride(), scale, window)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = make_params(q, k_cache, meta, scale, out, window)
        return params

    def _cuda_workspace(self, size: int, device) -> torch.Tensor:
        if self._workspace is None or self._workspace.numel() < size:
            self._workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        return self._workspace

    def _fall_back(self, status: int, q: torch.Tensor) -> None:
        reason = "dtype" if status == PA_ERR_DTYPE else "head size"
        log.warning("inflight: native paged attention does not support this %s (%s, head size %d); "
                    "using the torch reference", reason, q.dtype, q.shape[-1])
        self._use_fallback = True

    @staticmethod
    def _check(status: int) -> None:
        if status != PA_OK:
            raise RuntimeError(f"native paged attention failed with status {status}")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
