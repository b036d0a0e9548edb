"""The decoder layer stack in one native call (plugins/decoder, libinflight_decoder_cpu.so), through its C ABI.

With the native linear layout and fused ops (cpu_layout.py, cpu_ops.py) a layer is 10 kernel calls, with Python
between them (module calls, argument checks, views, output tensors). `DecoderStack` hands every layer's weights
and caches to the library once and runs the whole stack in one call a step, with the same kernels on the same
buffers in the same order, so its results are bitwise the module path's; the module path's decode steps took
1.26-1.43x as long on the medium model (benchmarks/decode_roofline.py times both). fp32 models, and bf16 ones on
the bf16 GEMM (PackedBf16Linear). Only for models the module path would run on exactly those kernels (`build`
says which); anything else keeps the modules.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import cast

import torch
from torch import nn

from ..attention.base import AttentionMetadata
from ..attention.native import NativePagedAttention
from ..paths import LIB_DIR
from .cpu_layout import PackedBf16Linear, PackedLinear
from .cpu_ops import NativeRMSNorm
from .llama import DecoderLayer, LlamaForCausalLM

DEC_OK = 0
DEC_ERRORS = {1: "shape", 2: "workspace", 3: "GEMM", 4: "fused op", 5: "paged attention"}
_PTR, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class DecLayer(ctypes.Structure):
    """Mirror of `dec_layer`."""

    _fields_ = [(name, _PTR) for name in (  # type: ignore[assignment]  # (mixed field types)
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
        "down_bias", "qkv_amx", "o_amx", "gate_up_amx", "down_amx", "k_cache",
        "v_cache")] + [("sliding_window", _I32), ("reserved", _I32)]


class DecStack(ctypes.Structure):
    """Mirror of `dec_stack`."""

    _fields_ = [(name, _I32) for name in (  # type: ignore[assignment]
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "block_size",
        "reserved")] + [("eps", _F32), ("scale", _F32)] + [
        (name, _I64) for name in ("kv_stride_block", "kv_stride_token", "kv_stride_head")] + [
        ("layers", ctypes.POINTER(DecLayer))]


class DecStep(ctypes.Structure):
    """Mirror of `dec_step`."""

    _fields_ = [(name, _I32) for name in (  # type: ignore[assignment]
        "num_tokens", "num_seqs", "max_blocks_per_seq", "max_context_len")] + [
        (name, _PTR) for name in ("cos", "sin", "block_tables", "context_lens", "query_start_loc", "slot_mapping",
                                  "rows")] + [("num_rows", _I64)]


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The stack library, or None when it has not been built."""
    path = LIB_DIR / "libinflight_decoder_cpu.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.dec_workspace_floats.restype, lib.dec_workspace_floats.argtypes = _I64, [ctypes.POINTER(DecStack), _I64]
    for name in ("dec_forward_f32", "dec_forward_bf16"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(DecStack), ctypes.POINTER(DecStep), _PTR, _PTR, _PTR,
                                                 _I64]
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _packed(linear: nn.Module | None) -> tuple[int, int | None, int | None]:
    if isinstance(linear, PackedBf16Linear):
        return linear.packed.data_ptr(), _ptr(linear.bias), None
    assert isinstance(linear, PackedLinear)
    return linear.packed.data_ptr(), _ptr(linear.bias), _ptr(linear.amx_packed)


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [cast(DecoderLayer, layer) for layer in model.model.layers]


class DecoderStack:
    """`model`'s decoder layers as one native call: `__call__(h, rope, kv_caches, meta)` -> (h, residual), as
    the loop over `model.model.layers` in LlamaForCausalLM.forward returns them (h is written in place)."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM) -> None:
        cfg = model.config
        self._lib, self._model = lib, model  # the model owns every weight the structs point to
        layers = _layers(model)
        self._layers = (DecLayer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            attn, mlp = layer.self_attn, layer.mlp
            slot.input_norm = _ptr(layer.input_layernorm.weight)
            slot.post_norm = _ptr(layer.post_attention_layernorm.weight)
            slot.qkv, slot.qkv_bias, slot.qkv_amx = _packed(attn.qkv_proj)
            slot.o, slot.o_bias, slot.o_amx = _packed(attn.o_proj)
            slot.gate_up, slot.gate_up_bias, slot.gate_up_amx = _packed(mlp.gate_up_proj)
            slot.down, slot.down_bias, slot.down_amx = _packed(mlp.down_proj)
            slot.sliding_window = attn.window
        self._stack = DecStack(num_layers=len(layers), hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                               num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               intermediate=cfg.intermediate_size, block_size=0,
                               eps=layers[0].input_layernorm.eps, scale=layers[0].self_attn.scale,
                               layers=self._layers)
        self._kv_caches: list | None = None  # the caches the layer structs point to
        self._dtype = layers[0].input_layernorm.weight.dtype  # fp32 or bf16 throughout (`build` checked)
        # (looked up on the library at each call, where a profiler's labelled wrapper can stand in for it)
        self._forward = "dec_forward_bf16" if self._dtype == torch.bfloat16 else "dec_forward_f32"
        self._workspace = torch.empty(0, dtype=self._dtype)

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list,
                 meta: AttentionMetadata, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` (int64): the last layer past attention only for these tokens, as DecoderLayer does."""
        if kv_caches is not self._kv_caches:
            self._bind(kv_caches)
        tokens = h.shape[0]
        need = self._lib.dec_workspace_floats(self._stack, tokens)
        if self._workspace.numel() < need:  # kept between steps: a prefill's buffers are not faulted in again
            self._workspace = torch.empty(need, dtype=self._dtype)
        cos, sin = rope
        if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
            rows = rows.to(torch.int64).contiguous()
        step = DecStep(num_tokens=tokens, num_seqs=len(meta.context_lens),
                       max_blocks_per_seq=meta.block_tables.shape[1], max_context_len=meta.max_context_len,
                       cos=cos.data_ptr(), sin=sin.data_ptr(), block_tables=meta.block_tables.data_ptr(),
                       context_lens=meta.context_lens_tensor.data_ptr(),
                       query_start_loc=meta.query_start_loc_tensor.data_ptr(),
                       slot_mapping=meta.slot_mapping.data_ptr(),
                       rows=None if rows is None else rows.data_ptr(), num_rows=0 if rows is None else len(rows))
        residual = torch.empty_like(h)
        status = getattr(self._lib, self._forward)(self._stack, step, h.data_ptr(), residual.data_ptr(),
                                                   self._workspace.data_ptr(), self._workspace.numel())
        if status != DEC_OK:
            raise RuntimeError(f"native decoder stack failed in its {DEC_ERRORS.get(status, status)} call")
        return (h, residual) if rows is None else (h[:len(rows)], residual[:len(rows)])

    def _bind(self, kv_caches: list) -> None:
        k0 = kv_caches[0][0]
        if k0.dtype != self._dtype or k0.device.type != "cpu" or not k0.is_contiguous():
            raise ValueError(f"the native decoder stack needs contiguous {self._dtype} CPU KV caches")
        for slot, (k, v) in zip(self._layers, kv_caches, strict=True):
            if k.shape != k0.shape or v.shape != k0.shape or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("the native decoder stack needs every layer's caches of one contiguous shape")
            slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
        self._stack.block_size = k0.shape[1]
        self._stack.kv_stride_block, self._stack.kv_stride_token, self._stack.kv_stride_head = k0.stride()[:3]
        self._kv_caches = kv_caches  # holds them: the structs point into their storage


def build(model: LlamaForCausalLM, lib: ctypes.CDLL | None = None) -> DecoderStack | None:
    """A DecoderStack for `model`, or None when the library is missing or the module path would not run on
    exactly its kernels: every linear layer packed (all fp32 PackedLinear, or all PackedBf16Linear) with q/k/v and
    gate/up merged, every norm fused with one eps, native paged attention on the CPU, no per-head q/k norms
    (Qwen3)."""
    lib = lib or load_library()
    if lib is None:
        return None
    layers = _layers(model)
    eps = layers[0].input_layernorm.eps
    kind = PackedBf16Linear if isinstance(layers[0].self_attn.o_proj, PackedBf16Linear) else PackedLinear
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        backend = attn.backend
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (all(isinstance(m, kind) for m in linears)
                and all(isinstance(n, NativeRMSNorm) and n.eps == eps for n in norms)
                and attn.q_norm is None and isinstance(backend, NativePagedAttention) and not backend.cuda):
            return None
    return DecoderStack(lib, model)
