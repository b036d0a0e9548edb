"""A bfloat16 model's linear layers on the CPU through the native bf16 GEMM (plugins/linear/include/bf16_gemm.h):
each output is the layer's exact sum, accumulated in fp32 and rounded once to bf16 (as torch's GEMM rounds it), for
any row count, stride and bias; the layout takes it where the processor has AVX512-BF16; and an engine built on
it gives transformers' bf16 logits, teacher-forced on the engine's own tokens, within bf16's rounding."""
import random

import pytest
import torch
from torch import nn

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.models import skinny_gemm
from inflight_backend.models.cpu_layout import PackedBf16Linear, convert_cpu_linears
from inflight_backend.request import SamplingParams


@pytest.fixture(scope="module")
def lib():
    library = skinny_gemm.load_library()
    if not skinny_gemm.bf16_available(library):
        pytest.skip("no AVX512-BF16 on this processor (or the library is not built): bf16 models keep torch's GEMM")
    return library


def check_rounded_sums(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """got (bf16) against the exact sums (float64): within half a bf16 unit of the exact value, plus what a K-term
    fp32 sum can lose; nearly every value the exact sum rounded."""
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    k = x.shape[1]
    fp32_sums = k * 2.0 ** -23 * (x.double().abs() @ weight.double().abs().t())
    err = (got.double() - exact).abs()
    assert torch.all(err <= exact.abs() * 2.0 ** -8 + fp32_sums + 1e-30)
    assert (got == exact.to(torch.bfloat16)).double().mean() > 0.99


# Widths: a partial tile, several tiles and a partial last one, an odd K (its last pair half zero); rows: every
# remainder of the 6-row blocks, one block (fetched ahead of its loads) and more than a 96-row slab.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 200])
@pytest.mark.parametrize("in_features, out_features", [(96, 20), (64, 200), (37, 70), (1030, 130)])
def test_bf16_linear_is_the_rounded_sum(lib, bias, rows, in_features, out_features):
    torch.manual_seed(rows * 3 + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    got = PackedBf16Linear(linear, lib)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    check_rounded_sums(got, x, linear.weight, None if linear.bias is None else linear.bias.float())


@pytest.mark.parametrize("rows", [319, 640])
def test_bf16_gemm_over_panels_past_l2_takes_longer_slabs(lib, rows):
    """Panels over 1 MiB (K = 1,024: 318-row slabs, bf16_panels.h's kSlabBytes): a slab and one more row, and two
    slabs and a short one."""
    torch.manual_seed(rows)
    weight_t = torch.randn(1024, 600).to(torch.bfloat16)  # 10 tiles, the last partial: 1.2 MiB of panels
    x = torch.randn(rows, 1024).to(torch.bfloat16)
    got = skinny_gemm.bf16_gemm(lib, x, skinny_gemm.bf16_pack(lib, weight_t), 600, None)
    check_rounded_sums(got, x, weight_t.t(), None)


@pytest.mark.parametrize("extra", [1, 8])
def test_bf16_gemm_reads_rows_with_any_stride(lib, extra):
    """x rows from a wider tensor: an odd row stride is copied into pairs, an even one read in place."""
    torch.manual_seed(extra)
    weight_t = torch.randn(96, 70).to(torch.bfloat16)
    wide = torch.randn(9, 96 + extra).to(torch.bfloat16)
    x = wide[:, :96]
    got = skinny_gemm.bf16_gemm(lib, x, skinny_gemm.bf16_pack(lib, weight_t), 70, None)
    assert torch.equal(got, skinny_gemm.bf16_gemm(lib, x.contiguous(), skinny_gemm.bf16_pack(lib, weight_t), 70, None))
    check_rounded_sums(got, x, weight_t.t(), None)


def test_layout_takes_it_for_bf16_models(lib):
    model = nn.Sequential(nn.Linear(40, 64), nn.Sequential(nn.ReLU(), nn.Linear(64, 24, bias=False)))
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16)
    expected = model(x)
    assert convert_cpu_linears(model, "auto", torch.bfloat16).startswith("native bf16 GEMM")
    assert sum(isinstance(m, PackedBf16Linear) for m in model.modules()) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, atol=0.05, rtol=0.02)


def test_auto_keeps_torch_for_bf16_where_amx_runs(lib, monkeypatch):
    """With AMX (oneDNN's bf16 prefills on tiles, not measured against ours) `auto` keeps torch's bf16 GEMM;
    `native` still takes the bf16 GEMM."""
    monkeypatch.setattr(skinny_gemm, "amx_available", lambda library: True)
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert convert_cpu_linears(model, "auto", torch.bfloat16) == "torch (input-major)"
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert convert_cpu_linears(model, "native", torch.bfloat16).startswith("native bf16 GEMM")


def test_native_bf16_needs_the_instructions(monkeypatch):
    """Where the processor has no AVX512-BF16, `native` refuses a bf16 model and `auto` keeps torch's GEMM."""
    monkeypatch.setattr(skinny_gemm, "bf16_available", lambda lib: False)
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16), "native", torch.bfloat16)
    assert convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16), "auto",
                               torch.bfloat16) == "torch (input-major)"


def test_engine_logits_follow_transformers_bf16(lib, tiny_model):
    """Prompt and generation logits of a bf16 engine on the native GEMM against transformers' bf16 model on the
    prompt + the engine's own tokens: within a few bf16 units of the logits (bf16 does not repeat bits across
    kernels: the sums' order differs, so tokens may part ways where two logits are within that)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, dtype="bfloat16", linear_backend="native",
                                         num_kv_blocks=256, max_batch_size=8))
    assert "native bf16 GEMM" in engine.runner.describe() and "fused CPU ops" in engine.runner.describe()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=12, return_generation_logits=True,
                                                       return_context_logits=True))
    outs = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outs[int(out.req_id)].append(out)
    for i, ids in enumerate(prompts):
        produced = [out for out in outs[i] if out.token_ids]
        generated = [t for out in produced for t in out.token_ids]
        context = next(out.context_logits for out in outs[i] if out.context_logits is not None)
        later = [torch.from_numpy(out.token_info.logits) for out in produced[1:]]  # the first is the prompt's last
        mine = torch.cat([torch.from_numpy(context)] + [row[None] for row in later])
        with torch.inference_mode():
            want = hf(torch.tensor([ids + generated])).logits[0].float()[: mine.shape[0]]
        assert (mine - want).abs().max() <= 0.04 * want.std()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
