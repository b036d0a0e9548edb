"""The native paged-attention kernels of plugins/paged_attention (CPU and CUDA), called through their C ABI."""
from __future__ import annotations

import logging

import torch

from . import kernel_abi as abi
from .base import AttentionBackend, AttentionMetadata
from .kernel_abi import PA_ERR_DTYPE, PA_ERR_SHAPE, PA_OK, PaParams
from .torch_ref import TorchPagedAttention

log = logging.getLogger("inflight")

PA_DTYPES = {torch.float32: abi.PA_FLOAT32, torch.bfloat16: abi.PA_BFLOAT16, torch.float16: abi.PA_FLOAT16}


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

    def __init__(self, lib, device_type: str) -> None:
        self.lib = lib
        self.cuda = device_type == "cuda"
        self._fallback = TorchPagedAttention()
        self._use_fallback = False
        self._workspace: torch.Tensor | None = None
        self._params_meta: AttentionMetadata | None = None  # the step whose kernel parameters are cached
        self._params: dict[tuple, PaParams] = {}

    def write_kv(self, k_cache, v_cache, k, v, meta):
        if self._use_fallback or k.stride() != v.stride():
            return self._fallback.write_kv(k_cache, v_cache, k, v, meta)
        p = self._step_params(k, k_cache, meta, 1.0, k)
        status = abi.write_kv(self.lib, self.cuda, p, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                              meta.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self._stream())
        if status in (PA_ERR_DTYPE, PA_ERR_SHAPE):
            self._fall_back(status, k)
            return self._fallback.write_kv(k_cache, v_cache, k, v, meta)
        self._check(status)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        if self._use_fallback:
            return self._fallback.forward(q, k_cache, v_cache, meta, scale, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        p = self._step_params(q, k_cache, meta, scale, out, window)
        workspace, size = 0, 0
        if self.cuda:
            buffer = self._cuda_workspace(abi.workspace_size(self.lib, p), q.device)
            workspace, size = buffer.data_ptr(), buffer.numel()
        status = abi.attention(self.lib, self.cuda, p, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               meta.block_tables.data_ptr(), meta.context_lens_tensor.data_ptr(),
                               meta.query_start_loc_tensor.data_ptr(), out.data_ptr(), workspace, size,
                               self._stream())
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

    @property
    def uses_fallback(self) -> bool:
        """True once a call went to the torch reference (a shape or dtype the kernel does not support)."""
        return self._use_fallback

    @property
    def workspace(self) -> torch.Tensor | None:
        """The CUDA kernel's scratch buffer as last sized (a larger call replaces it)."""
        return self._workspace

    def _cuda_workspace(self, size: int, device) -> torch.Tensor:
        if self._workspace is None or self._workspace.numel() < size:
            self._workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        return self._workspace

    def _fall_back(self, status: int, q: torch.Tensor) -> None:
        reason = "dtype" if status == PA_ERR_DTYPE else "head size"
        log.warning("inflight: native paged attention does not support this %s (%s, head size %d); "
                    "using the torch reference", reason, q.dtype, q.shape[-1])
        self._use_fallback = True

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.cuda else 0

    @staticmethod
    def _check(status: int) -> None:
        if status != PA_OK:
            raise RuntimeError(f"native paged attention failed with status {status}")

