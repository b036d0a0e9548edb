"""How the PagedAttention plugin's tensors map onto the paged-attention C ABI (plugins/paged_attention).

Kept apart from the plugin class so the very same mapping runs on the CPU in tests: host buffers into the CPU
kernel, device buffers into the CUDA kernel from the plugin's enqueue.

Plugin inputs: q (T, H, D), k (T, Hkv, D), v (T, Hkv, D), kv_pool (L, 2, NB, BS, Hkv, D), block_tables (S, MB),
context_lens (S,), query_start_loc (S + 1,), slot_mapping (T,); outputs: out (T, H, D), kv_pool_out (aliases
kv_pool). All contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention import kernel_abi as abi
from ..attention.kernel_abi import ITEMSIZE, PaParams

Q, K, V, POOL, BLOCK_TABLES, CONTEXT_LENS, QUERY_START_LOC, SLOT_MAPPING = range(8)


@dataclass(frozen=True)
class PluginFields:
    """The PagedAttention node's attributes (serialized with the plugin)."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    scale: float
    sliding_window: int = 0  # 0: full causal attention


def kernel_params(f: PluginFields, dims: list[tuple[int, ...]], pa_dtype: int) -> PaParams:
    num_tokens = dims[Q][0]
    num_seqs, max_blocks = dims[BLOCK_TABLES]
    row = f.num_kv_heads * f.head_size
    return PaParams(
        num_seqs=num_seqs, num_tokens=num_tokens, num_heads=f.num_heads, num_kv_heads=f.num_kv_heads,
        head_size=f.head_size, block_size=f.block_size, max_blocks_per_seq=max_blocks,
        max_context_len=max_blocks * f.block_size,  # an upper bound: the lengths themselves live on the device
        scale=f.scale, dtype=pa_dtype, sliding_window=f.sliding_window,
        q_stride_token=f.num_heads * f.head_size, q_stride_head=f.head_size,
        out_stride_token=f.num_heads * f.head_size, out_stride_head=f.head_size,
        kv_stride_block=f.block_size * row, kv_stride_token=row, kv_stride_head=f.head_size)


def layer_caches(f: PluginFields, pool_dims: tuple[int, ...], pool_ptr: int, pa_dtype: int) -> tuple[int, int]:
    """Addresses of this layer's K and V caches inside the pool (L, 2, NB, BS, Hkv, D)."""
    cache_bytes = pool_dims[2] * pool_dims[3] * pool_dims[4] * pool_dims[5] * ITEMSIZE[pa_dtype]
    k_cache = pool_ptr + (2 * f.layer) * cache_bytes
    return k_cache, k_cache + cache_bytes


def launch(lib, device: str, f: PluginFields, dims: list[tuple[int, ...]], pa_dtype: int, inputs: list[int],
           out_ptr: int, workspace: int = 0, workspace_size: int = 0, stream: int = 0) -> int:
    """Write the new K/V into their slots, then attend. Returns the kernels' status (0 is success)."""
    p = kernel_params(f, dims, pa_dtype)
    k_cache, v_cache = layer_caches(f, dims[POOL], inputs[POOL], pa_dtype)
    cuda = device == "cuda"
    status = abi.write_kv(lib, cuda, p, inputs[K], inputs[V], f.num_kv_heads * f.head_size, f.head_size,
                          inputs[SLOT_MAPPING], k_cache, v_cache, stream)
    return status or abi.attention(lib, cuda, p, inputs[Q], k_cache, v_cache, inputs[BLOCK_TABLES],
                                   inputs[CONTEXT_LENS], inputs[QUERY_START_LOC], out_ptr, workspace,
                                   workspace_size, stream)


def workspace_size(lib, f: PluginFields, max_dims: list[tuple[int, ...]], pa_dtype: int) -> int:
    """CUDA workspace for the largest shapes of the profile."""
    return abi.workspace_size(lib, kernel_params(f, max_dims, pa_dtype))
