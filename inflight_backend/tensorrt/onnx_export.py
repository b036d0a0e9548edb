"""Export a Llama checkpoint to ONNX in the engine's packed, paged form.

Graph inputs (T packed tokens, S sequences, N sampled tokens):
  input_ids (T,) int32, positions (T,) int32, kv_pool (L, 2, num_blocks, block_size, Hkv, D),
  block_tables (S, max_blocks) int32, context_lens (S,) int32, query_start_loc (S + 1,) int32,
  slot_mapping (T,) int64, sample_indices (N,) int32.
Graph outputs: logits (N, vocab) float32, kv_pool_out (the pool, updated in place by every layer).

`dtype` (float32, float16, bfloat16) types the weights, activations and KV pool, as the PyTorch engine does:
RMSNorm normalises in fp32 and rounds back (as transformers), rotary tables are computed in fp32 then rounded,
logits are returned in fp32. The graph is strongly typed: TensorRT builds it in exactly these types.

Each layer's attention (write the new K/V into their slots, then attend through the block table) is one
`PagedAttention` node in domain `inflight`, threading the pool from layer to layer; everything else is standard
ONNX (opset 18). Built with onnx.helper straight from the checkpoint's tensors.
"""
from __future__ import annotations

import os
from glob import glob

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file

from ..checkpoint import load_config
from ..models.llama import Rotary
from ..models.llama_config import LlamaConfig

DOMAIN = "inflight"
OP_TYPE = "PagedAttention"
OPSET = 18
ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


class GraphBuilder:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self, dtype: str = "float32") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self.dtype = dtype
        self.onnx_type = ONNX_TYPES[dtype]

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """An initializer in the graph's dtype (bfloat16 as raw bits: numpy has no bfloat16)."""
        if self.dtype == "float32":
            return self.const(name, array)
        if self.dtype == "float16":
            return self.const(name, array.astype(np.float16))
        bits = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
        self.initializers.append(helper.make_tensor(name, TensorProto.BFLOAT16, list(array.shape),
                                                    bits.numpy().tobytes(), raw=True))
        return name

    def cast(self, x: str, to: int) -> str:
        return x if to == TensorProto.FLOAT and self.dtype == "float32" else self.one("Cast", x, to=to)

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        self._count += 1
        outputs = [f"{op_type.lower()}_{self._count}_{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))
        return outputs

    def one(self, op_type: str, *inputs: str, **attrs) -> str:
        return self.op(op_type, list(inputs), **attrs)[0]


def export(checkpoint: str, block_size: int, path: str | None = None, dtype: str = "float32") -> onnx.ModelProto:
    """Build (and optionally save) the ONNX model for `checkpoint` with KV blocks of `block_size` tokens."""
    if dtype not in ONNX_TYPES:
        raise ValueError(f"dtype must be one of {sorted(ONNX_TYPES)}, got {dtype!r}")
    config = load_config(checkpoint)
    switches = [name for name in ("qkv_bias", "o_proj_bias", "mlp_bias", "qk_norm") if getattr(config, name)]
    if switches:
        raise ValueError(f"{checkpoint}: the TensorRT export covers Llama and Mistral without {', '.join(switches)} "
                         "(Qwen2 and Qwen3 run with engine: pytorch)")
    weights: dict[str, np.ndarray] = {}
    for shard in sorted(glob(os.path.join(checkpoint, "*.safetensors"))):
        weights.update({k: v.float().numpy() for k, v in load_file(shard).items()})
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model = _graph(config, weights, block_size, GraphBuilder(dtype))
    if path:
        onnx.save(model, path)
    return model


def _graph(cfg: LlamaConfig, w: dict[str, np.ndarray], block_size: int, g: GraphBuilder) -> onnx.ModelProto:
    pool_shape: list[str | int] = [cfg.num_hidden_layers, 2, "num_blocks", block_size, cfg.num_key_value_heads,
                                   cfg.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["T"]),
              helper.make_tensor_value_info("positions", TensorProto.INT32, ["T"]),
              helper.make_tensor_value_info("kv_pool", g.onnx_type, pool_shape),
              helper.make_tensor_value_info("block_tables", TensorProto.INT32, ["S", "max_blocks"]),
              helper.make_tensor_value_info("context_lens", TensorProto.INT32, ["S"]),
              helper.make_tensor_value_info("query_start_loc", TensorProto.INT32, ["S_plus_1"]),
              helper.make_tensor_value_info("slot_mapping", TensorProto.INT64, ["T"]),
              helper.make_tensor_value_info("sample_indices", TensorProto.INT32, ["N"])]
    x = g.one("Gather", g.weight("embed_tokens", w["model.embed_tokens.weight"]), "input_ids")  # (T, hidden)
    cos, sin = _rope_tables(g, cfg)
    pool = "kv_pool"
    for i in range(cfg.num_hidden_layers):
        x, pool = _layer(g, cfg, w, i, x, cos, sin, pool, block_size)
    sampled = g.one("Gather", x, "sample_indices", axis=0)  # (N, hidden)
    normed = _rms_norm(g, sampled, w["model.norm.weight"], cfg.rms_norm_eps, "final_norm")
    lm_head = g.weight("lm_head", w["lm_head.weight"].T)
    if g.dtype == "float32":
        g.nodes.append(helper.make_node("MatMul", [normed, lm_head], ["logits"]))
    else:
        g.nodes.append(helper.make_node("Cast", [g.one("MatMul", normed, lm_head)], ["logits"], to=TensorProto.FLOAT))
    g.nodes.append(helper.make_node("Identity", [pool], ["kv_pool_out"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", cfg.vocab_size]),
               helper.make_tensor_value_info("kv_pool_out", g.onnx_type, pool_shape)]
    graph = helper.make_graph(g.nodes, "inflight_llama", inputs, outputs, g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                             producer_name="inflight")


def _rope_tables(g: GraphBuilder, cfg: LlamaConfig) -> tuple[str, str]:
    """cos/sin (T, 1, D) for the packed positions, shared by every layer."""
    inv_freq = Rotary(cfg).inv_freq.numpy().astype(np.float32)[None, :]  # (1, D/2)
    pos = g.one("Unsqueeze", g.one("Cast", "positions", to=TensorProto.FLOAT), g.const("axis_1", np.array([1])))
    freqs = g.one("Mul", pos, g.const("inv_freq", inv_freq))  # (T, D/2)
    emb = g.one("Unsqueeze", g.one("Concat", freqs, freqs, axis=-1), "axis_1")  # (T, 1, D)
    return g.cast(g.one("Cos", emb), g.onnx_type), g.cast(g.one("Sin", emb), g.onnx_type)


def _rms_norm(g: GraphBuilder, x: str, weight: np.ndarray, eps: float, name: str) -> str:
    """weight * round_to_dtype(x / sqrt(mean(x^2) + eps)), normalised in fp32 as transformers does."""
    x = g.cast(x, TensorProto.FLOAT)
    mean_sq = g.one("ReduceMean", g.one("Mul", x, x), g.const(f"{name}_axes", np.array([-1])), keepdims=1)
    inv = g.one("Reciprocal", g.one("Sqrt", g.one("Add", mean_sq, g.const(f"{name}_eps",
                                                                          np.array(eps, dtype=np.float32)))))
    return g.one("Mul", g.cast(g.one("Mul", x, inv), g.onnx_type), g.weight(f"{name}_weight", weight))


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str, half: int, name: str) -> str:
    first = g.one("Slice", x, g.const(f"{name}_s0", np.array([0])), g.const(f"{name}_e0", np.array([half])),
                  g.const(f"{name}_ax", np.array([-1])))
    second = g.one("Slice", x, f"{name}_e0", g.const(f"{name}_e1", np.array([2 * half])), f"{name}_ax")
    rotated = g.one("Concat", g.one("Neg", second), first, axis=-1)
    return g.one("Add", g.one("Mul", x, cos), g.one("Mul", rotated, sin))


def _layer(g: GraphBuilder, cfg: LlamaConfig, w, i: int, x: str, cos: str, sin: str, pool: str,
           block_size: int) -> tuple[str, str]:
    p = f"model.layers.{i}."
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def linear(inp: str, name: str) -> str:
        return g.one("MatMul", inp, g.weight(f"l{i}_{name}", w[p + name + ".weight"].T))

    def heads_view(t: str, n: int, name: str) -> str:
        return g.one("Reshape", t, g.const(f"l{i}_{name}_shape", np.array([-1, n, d])))

    h = _rms_norm(g, x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps, f"l{i}_in_norm")
    q = _rotate(g, heads_view(linear(h, "self_attn.q_proj"), heads, "q"), cos, sin, d // 2, f"l{i}_q")
    k = _rotate(g, heads_view(linear(h, "self_attn.k_proj"), kv_heads, "k"), cos, sin, d // 2, f"l{i}_k")
    v = heads_view(linear(h, "self_attn.v_proj"), kv_heads, "v")
    attn, pool = g.op(OP_TYPE, [q, k, v, pool, "block_tables", "context_lens", "query_start_loc", "slot_mapping"],
                      num_outputs=2, domain=DOMAIN, layer=i, num_heads=heads, num_kv_heads=kv_heads, head_size=d,
                      block_size=block_size, scale=float(d ** -0.5),
                      sliding_window=cfg.layer_windows[i] if cfg.layer_windows else 0)
    flat = g.one("Reshape", attn, g.const(f"l{i}_attn_shape", np.array([-1, heads * d])))
    x = g.one("Add", x, linear(flat, "self_attn.o_proj"))
    h = _rms_norm(g, x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, f"l{i}_post_norm")
    gate = linear(h, "mlp.gate_proj")
    act = g.one("Mul", g.one("Mul", gate, g.one("Sigmoid", gate)), linear(h, "mlp.up_proj"))
    return g.one("Add", x, linear(act, "mlp.down_proj")), pool
