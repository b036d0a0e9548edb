"""TensorRT engine build without a GPU (TensorRT-RTX): one plugin layer per decoder layer, the plugin's shape and
type inference, serialized plans for several profiles."""
import json
import subprocess
import sys

import pytest

trt_module = pytest.importorskip("inflight_backend.tensorrt.trt_module")
try:
    trt = trt_module.import_trt()
except RuntimeError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(str(exc), allow_module_level=True)


def build(checkpoint, out, max_num_tokens, max_seqs, dtype="float32"):
    cmd = [sys.executable, "-m", "inflight_backend.cli", "build-engine", "--checkpoint", checkpoint, "--out",
           str(out), "--max-num-tokens", str(max_num_tokens), "--max-seqs", str(max_seqs), "--max-num-blocks", "256",
           "--dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "engine.json").read_text())


@pytest.mark.parametrize("checkpoint, layers", [("tiny_model", 2), ("gqa_model", 3)])
@pytest.mark.parametrize("max_num_tokens, max_seqs", [(64, 4), (512, 32)])
def test_build_engine_has_one_plugin_layer_per_decoder_layer(checkpoint, layers, max_num_tokens, max_seqs,
                                                             request, tmp_path):
    path = request.getfixturevalue(checkpoint)
    info = build(path, tmp_path / "engine", max_num_tokens, max_seqs)
    assert info["num_plugin_layers"] == layers
    assert (tmp_path / "engine" / "engine.plan").stat().st_size == info["plan_bytes"] > 0
    assert info["tensorrt"].startswith(trt.__name__)
    for layer in info["plugin_layers"]:
        q, k, v, pool = (layer["inputs"][i] for i in range(4))
        out, pool_out = layer["outputs"]
        assert out["shape"] == q["shape"] and out["dtype"] == q["dtype"] == "FLOAT"
        assert pool_out["shape"] == pool["shape"] and pool_out["dtype"] == pool["dtype"]
        assert q["shape"][1:] != k["shape"][1:] or checkpoint == "tiny_model"  # GQA: fewer KV heads
        assert [t["dtype"] for t in layer["inputs"][4:]] == ["INT32", "INT32", "INT32", "INT64"]


@pytest.mark.parametrize("dtype, trt_type", [("float16", "HALF"), ("bfloat16", "BF16")])
def test_low_precision_engines_run_attention_and_keep_the_pool_in_that_type(dtype, trt_type, gqa_model, tmp_path):
    info = build(gqa_model, tmp_path / "engine", 128, 8, dtype)
    assert info["spec"]["dtype"] == dtype and info["num_plugin_layers"] == 3
    assert info["io"]["kv_pool"] == info["io"]["kv_pool_out"] == trt_type
    assert info["io"]["logits"] == "FLOAT" and info["io"]["input_ids"] == "INT32"
    for layer in info["plugin_layers"]:
        assert [t["dtype"] for t in layer["inputs"][:4]] == [trt_type] * 4
        assert [t["dtype"] for t in layer["outputs"]] == [trt_type] * 2


def test_plugin_type_inference_follows_the_inputs():
    from inflight_backend.tensorrt.kernel_args import PluginFields
    from inflight_backend.tensorrt.plugin import PagedAttentionPlugin

    plugin = PagedAttentionPlugin(PluginFields(0, 8, 2, 64, 16, 0.125))
    for dtype in (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16):
        types = [dtype] * 4 + [trt.DataType.INT32] * 3 + [trt.DataType.INT64]
        assert plugin.get_output_data_types(types) == [dtype, dtype]
    assert plugin.get_aliased_input(1) == 3 and plugin.get_aliased_input(0) == -1
    fields = {f.name: f.data for f in plugin.get_fields_to_serialize()}
    assert int(fields["num_kv_heads"][0]) == 2 and float(fields["scale"][0]) == 0.125
