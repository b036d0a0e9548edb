"""`inflight build-engine`: export to ONNX, parse with the TensorRT ONNX parser (our PagedAttention nodes become
plugin layers), build with optimization profiles over tokens and sequences, write the plan and a JSON description."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..block_manager import blocks_for
from ..checkpoint import load_config
from .onnx_export import export


@dataclass(frozen=True)
class EngineSpec:
    checkpoint: str
    block_size: int = 16
    max_num_tokens: int = 1024
    max_seqs: int = 64
    max_num_blocks: int = 4096
    dtype: str = "float32"


def parse_network(onnx_path: Path):
    """(trt, builder, network) with the ONNX model parsed; raises with the parser's errors."""
    from .plugin import register, trt

    register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: the graph's own types (fp32 / fp16 / bf16, fp32 RMSNorm) are what runs.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    return trt, builder, network


def plugin_layers(trt, network) -> list:
    return [network.get_layer(i) for i in range(network.num_layers)
            if network.get_layer(i).type == trt.LayerType.PLUGIN_V3]


def describe_plugin_layers(trt, network) -> list[dict]:
    """Inputs and inferred outputs (shape, dtype) of every PagedAttention layer, -1 for dynamic dimensions."""

    def tensor(t):
        return {"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1]}

    return [{"name": layer.name, "inputs": [tensor(layer.get_input(i)) for i in range(layer.num_inputs)],
             "outputs": [tensor(layer.get_output(i)) for i in range(layer.num_outputs)]}
            for layer in plugin_layers(trt, network)]


def _io(trt, network) -> dict[str, str]:
    """Type of every network input and output, e.g. {"kv_pool": "HALF", "logits": "FLOAT"}."""
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [network.get_output(i) for i in range(network.num_outputs)]
    return {t.name: str(t.dtype).split(".")[-1] for t in tensors}


def profile_shapes(spec: EngineSpec) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shape of every dynamic input."""
    cfg = load_config(spec.checkpoint)
    max_blocks = blocks_for(cfg.max_position_embeddings, spec.block_size)
    t, s = spec.max_num_tokens, spec.max_seqs
    pool = (cfg.num_hidden_layers, 2)
    tail = (spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
    return {
        "input_ids": ((1,), (s,), (t,)), "positions": ((1,), (s,), (t,)), "slot_mapping": ((1,), (s,), (t,)),
        "kv_pool": (pool + (1,) + tail, pool + (spec.max_num_blocks,) + tail, pool + (spec.max_num_blocks,) + tail),
        "block_tables": ((1, 1), (s, max_blocks // 4 or 1), (s, max_blocks)),
        "context_lens": ((1,), (s,), (s,)), "query_start_loc": ((2,), (s + 1,), (s + 1,)),
        "sample_indices": ((1,), (s,), (s,)),
    }


def build_engine(spec: EngineSpec, out_dir: str | Path) -> dict:
    """Write out_dir/{model.onnx, engine.plan, engine.json}; returns the JSON description."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    export(spec.checkpoint, spec.block_size, str(out / "model.onnx"), spec.dtype)
    trt, builder, network = parse_network(out / "model.onnx")
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(spec)
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine (see the log above)")
    (out / "engine.plan").write_bytes(bytes(plan))
    description = {"spec": asdict(spec), "tensorrt": f"{trt.__name__} {trt.__version__}",
                   "num_plugin_layers": len(plugin_layers(trt, network)),
                   "plugin_layers": describe_plugin_layers(trt, network),
                   "num_layers": network.num_layers, "io": _io(trt, network),
                   "profile": {k: list(map(list, v)) for k, v in shapes.items()},
                   "plan_bytes": len(bytes(plan))}
    (out / "engine.json").write_text(json.dumps(description, indent=2))
    return description
