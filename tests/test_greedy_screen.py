"""The LM head's greedy screen (plugins/linear/include/greedy_screen.h, models/greedy_screen.py): after refine, each
row's argmax and its logit are bitwise the fp32 skinny GEMM's, near ties, exact ties, masks and rows it cannot
approximate included; the engine screens only steps whose every request is plain greedy, and its tokens are the
unscreened engine's."""
import pytest
import torch
from torch import nn

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.models import greedy_screen, skinny_gemm
from inflight_backend.models.cpu_layout import PackedLinear
from inflight_backend.request import SamplingParams


@pytest.fixture(scope="module")
def sgemm():
    library = skinny_gemm.load_library()
    if library is None:
        pytest.skip("build/lib/libinflight_sgemm_cpu.so is not built with AVX-512 or AVX2+FMA on this machine")
    return library


@pytest.fixture(scope="module", params=[greedy_screen.HARDWARE, greedy_screen.WIDENED])
def lib(request, sgemm):
    """The library, its screen on each path this processor has: AVX512-BF16, and bf16 widened in AVX2 registers
    (the only one without the instruction)."""
    if greedy_screen.path(sgemm) == 0:
        pytest.skip("this processor has neither AVX512-BF16 nor AVX2+FMA: the greedy screen cannot run here")
    sgemm.gs_widen_only(request.param == greedy_screen.WIDENED)
    if greedy_screen.path(sgemm) != request.param:
        sgemm.gs_widen_only(0)
        pytest.skip("this processor has no AVX512-BF16: the screen's dot-product path cannot run here")
    yield sgemm
    sgemm.gs_widen_only(0)


def head(lib, weight: torch.Tensor):
    """The fp32 head and its screen for a (vocab, hidden) weight."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    packed = PackedLinear(linear, lib)
    return packed, greedy_screen.GreedyScreen(lib, linear.weight, packed.packed)


def check_rows(screened: torch.Tensor, exact: torch.Tensor) -> None:
    """Each row's argmax and its value as the whole head's (`exact`); every other entry below the row's maximum
    or equal to the head's value."""
    assert torch.equal(screened.argmax(dim=1), exact.argmax(dim=1))
    top = exact.max(dim=1, keepdim=True).values
    assert torch.equal(screened.max(dim=1, keepdim=True).values, top)
    assert torch.all((screened < top) | (screened == exact))


def test_sg_dot_columns_is_bitwise_the_gemm(sgemm):
    torch.manual_seed(0)
    for k, n in [(1, 1), (37, 70), (1030, 200)]:  # a partial tile; several chunks of k on every build
        weight_t, x = torch.randn(k, n), torch.randn(1, k)
        packed = skinny_gemm.pack(sgemm, weight_t)
        y = skinny_gemm.gemm(sgemm, x, packed, n, None)
        cols = torch.randperm(n).to(torch.int32)
        out = torch.empty(n)
        assert sgemm.sg_dot_columns(x.data_ptr(), k, packed.data_ptr(), n, cols.data_ptr(), n, out.data_ptr()) == 0
        assert torch.equal(out, y[0, cols.long()])
    bad = torch.tensor([n], dtype=torch.int32)
    assert sgemm.sg_dot_columns(x.data_ptr(), k, packed.data_ptr(), n, bad.data_ptr(), 1, out.data_ptr()) != 0


# Rows: one, a partial row block, several (7 and 40: blocks of 4+3, and of 6 and 5); hidden sizes odd (a half
# pair) and even; vocabularies with a partial last tile.
@pytest.mark.parametrize("rows", [1, 5, 7, 40])
@pytest.mark.parametrize("hidden, vocab", [(33, 100), (256, 3000), (1024, 4097)])
def test_refined_argmax_is_the_fp32_heads(lib, rows, hidden, vocab):
    torch.manual_seed(rows + hidden + vocab)
    fp32_head, screen = head(lib, torch.randn(vocab, hidden) * 0.05)
    x = torch.randn(rows, hidden)
    fp32 = fp32_head(x)
    approx = screen.screen(x)
    assert not torch.equal(approx, fp32)  # a bf16 pass, not the fp32 one
    assert (approx - fp32).abs().max() < 0.01 * fp32.abs().max()
    before = screen.recomputed
    screen.refine(approx)
    check_rows(approx, fp32)
    assert rows <= screen.recomputed - before < rows * vocab // 10  # the argmax at least, a few others at most


@pytest.mark.parametrize("rows", [1, 6, 7])
def test_screen_is_the_same_for_every_prefetch_plan(lib, rows):
    """One row block fetches the head a few rows ahead of its loads, more fetch the next tile
    (skinny_gemm.stream_ahead): the screened logits are the same bits either way."""
    torch.manual_seed(rows)
    _, screen = head(lib, torch.randn(300, 64) * 0.05)
    check_prefetch_plans(lib, screen, torch.randn(rows, 64))


def check_prefetch_plans(lib, screen, x: torch.Tensor) -> None:
    """The screen's logits of x with the stream-ahead fetch off and at its chosen distance: the same bits."""
    chosen = skinny_gemm.stream_ahead(lib)
    try:
        outs = [(skinny_gemm.stream_ahead(lib, ahead), screen.screen(x))[1] for ahead in (0, chosen)]
    finally:
        skinny_gemm.stream_ahead(lib, chosen)
    assert torch.equal(outs[0], outs[1])


def test_near_and_exact_ties_resolve_as_in_fp32(lib):
    torch.manual_seed(1)
    hidden, vocab = 128, 640
    weight = torch.randn(vocab, hidden) * 0.05
    x = torch.randn(8, hidden)
    best = (x @ weight.T).argmax(dim=1)
    # near ties: a column one ulp away from each row's best in one weight; exact ties: the same column twice
    for row, col in enumerate(best.tolist()):
        twin = (col * 7 + 3 + row) % vocab
        weight[twin] = weight[col]
        if row % 2:
            weight[twin, row] = torch.nextafter(weight[col, row], torch.tensor(float("inf")))
    fp32_head, screen = head(lib, weight)
    fp32, approx = fp32_head(x), screen.screen(x)
    screen.refine(approx)
    check_rows(approx, fp32)


def check_masks(exact: torch.Tensor, approx: torch.Tensor, screen) -> None:
    """Six rows: each row's three best approximate logits masked (as the rules would) before refine, and the
    last row all masked; the refined rows' argmax is the masked head's, the all-masked row stays so."""
    banned = approx.topk(3, dim=1).indices
    approx.scatter_(1, banned, float("-inf"))
    exact.scatter_(1, banned, float("-inf"))
    approx[5] = float("-inf")
    exact[5] = float("-inf")
    screen.refine(approx)
    check_rows(approx[:5], exact[:5])
    assert torch.all(approx[5] == float("-inf"))


def test_masks_before_refine_are_respected(lib):
    torch.manual_seed(2)
    fp32_head, screen = head(lib, torch.randn(500, 64) * 0.05)
    x = torch.randn(6, 64)
    check_masks(fp32_head(x), screen.screen(x), screen)


def test_rows_it_cannot_bound_are_the_fp32_heads_whole(lib):
    torch.manual_seed(3)
    fp32_head, screen = head(lib, torch.randn(300, 48) * 0.05)
    x = torch.randn(4, 48)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    x[2] *= 1e35  # logits that could overflow
    fp32, approx = fp32_head(x), screen.screen(x)
    assert torch.equal(approx[:3].nan_to_num(), fp32[:3].nan_to_num())
    assert torch.equal(approx[:3].isnan(), fp32[:3].isnan())
    screen.refine(approx)
    assert torch.equal(approx[:3].nan_to_num(), fp32[:3].nan_to_num())
    check_rows(approx[3:], fp32[3:])


def test_screen_refuses_a_non_finite_weight_and_a_stray_refine(lib):
    weight = torch.randn(20, 16)
    weight[3, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        head(lib, weight)
    _, screen = head(lib, torch.randn(20, 16))
    with pytest.raises(RuntimeError, match="refine needs"):
        screen.refine(torch.zeros(1, 20))


def engine(path: str, screen: str, dtype: str = "auto") -> InflightEngine:
    return InflightEngine(EngineConfig(checkpoint=path, dtype=dtype, num_kv_blocks=256, max_batch_size=8,
                                       max_num_tokens=256, greedy_screen=screen))


def generate(eng: InflightEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    out = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        eng.add_request(rid, ids, params)
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.req_id] += o.token_ids
    return out


def test_engine_screens_greedy_steps_only_and_gives_the_same_tokens(lib, tiny_model):
    screened, plain = engine(tiny_model, "on"), engine(tiny_model, "off")
    screen = screened.runner.model.greedy_screen
    assert screen is not None and plain.runner.model.greedy_screen is None
    assert "screened in bf16" in screened.runner.describe()
    greedy = {"a": ([1, 5, 9, 2], SamplingParams(max_tokens=12, min_tokens=12)),  # end ids masked throughout
              "b": ([7, 7, 3], SamplingParams(max_tokens=9, bad_token_seqs=((4,), (8, 9)))),
              "c": ([11] * 20, SamplingParams(max_tokens=15))}
    assert generate(screened, greedy) == generate(plain, greedy)
    assert screen.recomputed > 0
    # a sampled or penalized request, or one asking for log-probabilities, makes its steps compute every logit
    for params in (SamplingParams(max_tokens=5, temperature=0.8, seed=1),
                   SamplingParams(max_tokens=5, repetition_penalty=1.3),
                   SamplingParams(max_tokens=5, logprobs=2)):
        before = screen.recomputed
        mixed = {"g": ([3, 1, 4], SamplingParams(max_tokens=5)), "o": ([1, 5, 9], params)}
        assert generate(screened, mixed) == generate(plain, mixed)
        assert screen.recomputed == before
    assert screened.blocks.num_free_blocks == screened.blocks.num_blocks


def check_stops(screened: InflightEngine, plain: InflightEngine, share: int) -> None:
    """A screen asked to stop past half a logit a row stops after its first step, the tokens unchanged; that
    refine recomputed under 1/`share` of the vocabulary a row."""
    screen = screened.runner.model.greedy_screen
    screen.most_per_row = 0.5  # every refine recomputes one logit a row at least: the first step is the last
    requests = {"a": ([1, 5, 9, 2], SamplingParams(max_tokens=6)), "b": ([4, 4], SamplingParams(max_tokens=6))}
    assert generate(screened, requests) == generate(plain, requests)
    assert not screen.worthwhile and 2 <= screen.recomputed < 2 * screened.runner.vocab_size // share


def test_screen_stops_where_it_recomputes_too_many_logits(lib, tiny_model):
    check_stops(engine(tiny_model, "on"), engine(tiny_model, "off"), 10)


def test_greedy_screen_setting_is_checked(sgemm, tiny_model):
    with pytest.raises(ValueError, match="greedy_screen must be one of"):
        EngineConfig(checkpoint="m", greedy_screen="bf16")
    with pytest.raises(RuntimeError, match="greedy_screen: on"):
        InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64, linear_backend="torch",
                                    greedy_screen="on"))
    off = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64, greedy_screen="off"))
    assert off.runner.model.greedy_screen is None and not off.runner.screens_greedy


def test_auto_takes_the_dot_product_path_only(sgemm, tiny_model):
    if greedy_screen.path(sgemm) == 0:
        pytest.skip("this processor has neither AVX512-BF16 nor AVX2+FMA: the greedy screen cannot run here")
    sgemm.gs_widen_only(1)  # as on a processor without AVX512-BF16
    try:
        assert greedy_screen.path(sgemm) == greedy_screen.WIDENED
        assert engine(tiny_model, "auto").runner.model.greedy_screen is None  # slower than the fp32 head there
        widened = engine(tiny_model, "on")
        assert widened.runner.screens_greedy and "(AVX2, widened)" in widened.runner.describe()
    finally:
        sgemm.gs_widen_only(0)
