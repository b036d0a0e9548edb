"""The decoder layer stack in one native call (models/decoder_stack.py, plugins/decoder) against the module path it
replaces: bitwise the same logits at every step (prefills, chunks and decodes sharing steps), on Llama, GQA,
Qwen2's biases and tied embeddings, and sliding windows, in fp32 and (on the bf16 GEMM) bf16; chosen only where the
modules run on its kernels."""
import ctypes

import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.models import decoder_stack, skinny_gemm
from inflight_backend.request import SamplingParams
from tests.test_model_families import make_family_checkpoint


@pytest.fixture(scope="module")
def lib():
    library = decoder_stack.load_library()
    if library is None:
        pytest.fail("build/lib/libinflight_decoder_cpu.so is missing: run `make native`")
    return library


def engine_for(path, **overrides):
    values = dict(checkpoint=path, num_kv_blocks=256, max_batch_size=8, max_num_tokens=96,
                  enable_chunked_prefill=True, max_chunk_tokens=40, dtype="float32")
    engine = InflightEngine(EngineConfig(**(values | overrides)))
    if engine.runner.model.decoder_stack is None:
        pytest.skip("no native decoder stack: the skinny GEMM is not built for this processor (no PackedLinear), or "
                    "a bf16 model without AVX512-BF16")
    return engine


def run_both_ways(engine, cases):
    """Run `cases` arriving two steps apart; every step's model call runs twice on the same inputs, through the
    stack and through the modules (the second writes the same K/V again). Returns the pairs of logits and the
    largest step's token count."""
    runner, model = engine.runner, engine.runner.model
    stack, execute, pairs, tokens = model.decoder_stack, runner.execute, [], [0]

    def both(output, **kw):
        tokens[0] = max(tokens[0], sum(item.num_tokens for item in output.scheduled))
        model.decoder_stack = None
        modules = execute(output, **kw).clone()
        model.decoder_stack = stack
        native = execute(output, **kw)
        pairs.append((native.clone(), modules))
        return native

    runner.execute = both
    step = 0
    while step < 2 * len(cases) or engine.has_unfinished():
        if step % 2 == 0 and step // 2 < len(cases):
            ids, n = cases[step // 2]
            engine.add_request(str(step), ids, SamplingParams(max_tokens=n))
        engine.step()
        step += 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return pairs, tokens[0]


def assert_bitwise(pairs, min_steps=10):
    assert len(pairs) >= min_steps
    for step, (native, modules) in enumerate(pairs):
        assert torch.equal(native, modules), f"step {step}: largest difference {(native - modules).abs().max()}"


# bf16 runs on the bf16 GEMM where the processor has AVX512-BF16 (else the layout is torch's: no stack, skipped).
DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_are_the_modules_bitwise_on_llama_with_gqa(gqa_model, oracle_cases, lib, dtype):
    engine = engine_for(gqa_model, dtype=dtype)
    assert "layers in one native call" in engine.runner.describe()
    assert_bitwise(run_both_ways(engine, [(ids, min(n, 12)) for ids, n in oracle_cases[:10]])[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen2_window"])
def test_logits_are_the_modules_bitwise_on_biases_tied_weights_and_windows(tmp_path, oracle_cases, lib, family,
                                                                            dtype):
    make_family_checkpoint(str(tmp_path), family)
    engine = engine_for(str(tmp_path), block_size=8, dtype=dtype)
    assert_bitwise(run_both_ways(engine, [(ids, min(n, 12)) for ids, n in oracle_cases[:8]])[0])


def test_prefill_larger_than_any_step_before_grows_the_workspace(tiny_model, oracle_cases, lib):
    engine = engine_for(tiny_model, max_num_tokens=512, enable_chunked_prefill=False, max_chunk_tokens=0)
    cases = sorted(oracle_cases, key=lambda case: len(case[0]))[::5]  # the longest prompt last
    pairs, largest = run_both_ways(engine, [(ids, 3) for ids, _ in cases])
    assert_bitwise(pairs, min_steps=len(cases) + 2)
    stack = engine.runner.model.decoder_stack
    assert largest > len(cases[-1][0]) - 1
    assert stack._workspace.numel() == lib.dec_workspace_floats(stack._stack, largest)  # grown to fit, no more
    sgemm = skinny_gemm.load_library()
    if skinny_gemm.amx_available(sgemm):  # the prefills multiplied through AMX, in both paths alike
        assert largest >= skinny_gemm.amx_min_rows(sgemm) and stack._layers[0].gate_up_amx


def test_only_models_the_modules_would_run_on_its_kernels(tiny_model, tmp_path):
    assert InflightEngine(EngineConfig(checkpoint=tiny_model, attention_backend="torch")).runner.model.decoder_stack \
        is None
    assert InflightEngine(EngineConfig(checkpoint=tiny_model, linear_backend="torch")).runner.model.decoder_stack \
        is None
    make_family_checkpoint(str(tmp_path), "qwen3")  # per-head q/k norms: not in the stack
    assert InflightEngine(EngineConfig(checkpoint=str(tmp_path), dtype="float32")).runner.model.decoder_stack is None


def test_shapes_checked_and_a_short_workspace_refused(tiny_model, lib):
    engine = engine_for(tiny_model)
    stack = engine.runner.model.decoder_stack
    stack._bind(engine.runner.kv_caches)  # (done by its first step)
    step = decoder_stack.DecStep(num_tokens=0, num_seqs=0)
    h = torch.zeros(4, 128)
    assert lib.dec_forward_f32(stack._stack, step, h.data_ptr(), h.data_ptr(), None, 0) == decoder_stack.DEC_OK
    step.num_tokens = 4
    need = lib.dec_workspace_floats(stack._stack, 4)
    assert need > 4 * 128
    assert lib.dec_forward_f32(stack._stack, step, h.data_ptr(), h.data_ptr(), None, need - 1) == 2  # workspace
    step.num_rows = -1
    assert lib.dec_forward_f32(stack._stack, step, h.data_ptr(), h.data_ptr(), None, need) == 1  # shape
    step.num_rows = 0
    bad = decoder_stack.DecStack(num_layers=0, layers=ctypes.cast(None, ctypes.POINTER(decoder_stack.DecLayer)))
    assert lib.dec_forward_f32(bad, step, h.data_ptr(), h.data_ptr(), None, 0) == 1  # shape


def test_the_last_layer_goes_past_attention_for_the_sampled_rows_alone(tiny_model, oracle_cases):
    """A prompt's non-final tokens need every layer's K and V but no logits: the last layer's MLP sees one row per
    sampled sequence (the native stack does the same, which the bitwise tests above hold it to)."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, attention_backend="torch"))
    layers = engine.runner.model.model.layers
    seen: dict[str, list[int]] = {"first": [], "last": []}
    layers[0].mlp.register_forward_pre_hook(lambda _, args: seen["first"].append(args[0].shape[0]))
    layers[-1].mlp.register_forward_pre_hook(lambda _, args: seen["last"].append(args[0].shape[0]))
    ids, _ = max(oracle_cases, key=lambda case: len(case[0]))
    engine.add_request("a", ids, SamplingParams(max_tokens=2))
    engine.add_request("b", ids[:50], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert seen["first"] == [len(ids) + 50, 2] and seen["last"] == [2, 2]
