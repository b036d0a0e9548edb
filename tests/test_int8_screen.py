"""A bfloat16 model's LM head screened in int8 (plugins/linear/include/int8_screen.h, models/greedy_screen.py):
every approximate logit within its proven bound of the bf16 GEMM's; after refine, each row's argmax and its logit
are bitwise the bf16 GEMM's, near ties, exact ties, masks and rows it cannot approximate included; the engine's
greedy tokens are the unscreened engine's."""
import pytest
import torch
from torch import nn

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.models import greedy_screen, skinny_gemm
from inflight_backend.models.cpu_layout import PackedBf16Linear
from inflight_backend.request import SamplingParams
from tests.test_greedy_screen import check_masks, check_prefetch_plans, check_rows, check_stops, engine, generate


@pytest.fixture(scope="module")
def lib():
    library = skinny_gemm.load_library()
    if not greedy_screen.int8_available(library):
        pytest.skip("the int8 screen needs AVX512-VNNI and AVX512-BF16 (and build/lib/libinflight_sgemm_cpu.so "
                    "built on such a processor)")
    return library


def head(lib, weight: torch.Tensor):
    """The bf16 head (the native bf16 GEMM) and its int8 screen for a (vocab, hidden) weight."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    linear.weight.data.copy_(weight)
    packed = PackedBf16Linear(linear, lib)
    return packed, greedy_screen.Int8Screen(lib, linear.weight, packed.packed)


# Rows: one, a partial row block, several (7 and 40); hidden sizes odd (a half pair, a partial quad) and even;
# vocabularies with a partial last tile.
@pytest.mark.parametrize("rows", [1, 5, 7, 40])
@pytest.mark.parametrize("hidden, vocab", [(33, 100), (258, 3000), (1024, 4097)])
def test_screen_is_within_its_bound_and_refine_gives_the_bf16_heads_argmax(lib, rows, hidden, vocab):
    torch.manual_seed(rows + hidden + vocab)
    bf16_head, screen = head(lib, (torch.randn(vocab, hidden) * 0.05).to(torch.bfloat16))
    x = torch.randn(rows, hidden).to(torch.bfloat16)
    exact = bf16_head(x).float()
    approx = screen.screen(x)
    assert not torch.equal(approx, exact)  # an int8 pass, not the bf16 one
    for i in range(rows):
        bounds = screen.bounds(x[i], approx[i].abs().max().item())
        assert torch.all((approx[i] - exact[i]).abs() <= bounds)
    before = screen.recomputed
    screen.refine(approx)
    check_rows(approx, exact)
    assert rows <= screen.recomputed - before < rows * vocab // 4  # the argmax at least, a share of the rest at most


@pytest.mark.parametrize("rows", [1, 4, 6, 7])
def test_screen_is_the_same_for_every_prefetch_plan(lib, rows):
    """One row block of up to 4 rows streams the panels a distance ahead of its loads, others fetch the next
    tile (skinny_gemm.stream_ahead): the screened logits are the same bits either way."""
    torch.manual_seed(rows)
    _, screen = head(lib, (torch.randn(300, 64) * 0.05).to(torch.bfloat16))
    check_prefetch_plans(lib, screen, torch.randn(rows, 64).to(torch.bfloat16))


def test_near_and_exact_ties_resolve_as_in_bf16(lib):
    torch.manual_seed(1)
    hidden, vocab = 128, 640
    weight = (torch.randn(vocab, hidden) * 0.05).to(torch.bfloat16)
    x = torch.randn(8, hidden).to(torch.bfloat16)
    best = (x.float() @ weight.float().T).argmax(dim=1)
    # near ties: a column one bf16 step away from each row's best in one weight; exact ties: the same column twice
    for row, col in enumerate(best.tolist()):
        twin = (col * 7 + 3 + row) % vocab
        weight[twin] = weight[col]
        if row % 2:
            weight[twin, row] = torch.nextafter(weight[col, row].float(), torch.tensor(float("inf"))).bfloat16()
            if weight[twin, row] == weight[col, row]:  # (nextafter in fp32 rounds back: one bf16 step up)
                weight[twin, row] = (weight[col, row].view(torch.int16) + 1).view(torch.bfloat16)
    bf16_head, screen = head(lib, weight)
    exact, approx = bf16_head(x).float(), screen.screen(x)
    screen.refine(approx)
    check_rows(approx, exact)


def test_masks_before_refine_are_respected(lib):
    torch.manual_seed(2)
    bf16_head, screen = head(lib, (torch.randn(500, 64) * 0.05).to(torch.bfloat16))
    x = torch.randn(6, 64).to(torch.bfloat16)
    check_masks(bf16_head(x).float(), screen.screen(x), screen)


def test_rows_it_cannot_bound_are_the_bf16_heads_whole(lib):
    torch.manual_seed(3)
    bf16_head, screen = head(lib, (torch.randn(300, 48) * 0.05).to(torch.bfloat16))
    x = torch.randn(5, 48)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    x[2] *= 1e35  # logits that could overflow
    x[3] = 0.0  # nothing to scale by
    x = x.to(torch.bfloat16)
    exact, approx = bf16_head(x).float(), screen.screen(x)
    assert torch.equal(approx[:4].nan_to_num(), exact[:4].nan_to_num())
    assert torch.equal(approx[:4].isnan(), exact[:4].isnan())
    assert screen.bounds(x[0], 1.0) is None and screen.bounds(x[3], 1.0) is None
    screen.refine(approx)
    assert torch.equal(approx[:4].nan_to_num(), exact[:4].nan_to_num())
    check_rows(approx[4:], exact[4:])


def test_screen_refuses_a_non_finite_weight_and_a_stray_refine(lib):
    weight = torch.randn(20, 16).to(torch.bfloat16)
    weight[3, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        head(lib, weight)
    _, screen = head(lib, torch.randn(20, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="refine needs"):
        screen.refine(torch.zeros(1, 20))


@pytest.mark.parametrize("checkpoint", ["tiny_model", "tied_model"])
def test_bf16_engine_screens_greedy_steps_in_int8_and_gives_the_same_tokens(lib, checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    screened, plain = engine(path, "on", "bfloat16"), engine(path, "off", "bfloat16")
    screen = screened.runner.model.greedy_screen
    assert isinstance(screen, greedy_screen.Int8Screen) and plain.runner.model.greedy_screen is None
    assert "screened in int8" in screened.runner.describe()
    assert isinstance(engine(path, "auto", "bfloat16").runner.model.greedy_screen, greedy_screen.Int8Screen)
    greedy = {"a": ([1, 5, 9, 2], SamplingParams(max_tokens=12, min_tokens=12)),  # end ids masked throughout
              "b": ([7, 7, 3], SamplingParams(max_tokens=9, bad_token_seqs=((4,), (8, 9)))),
              "c": ([11] * 20, SamplingParams(max_tokens=15))}
    assert generate(screened, greedy) == generate(plain, greedy)
    assert screen.recomputed > 0
    before = screen.recomputed  # a sampled request makes its steps compute every logit
    mixed = {"g": ([3, 1, 4], SamplingParams(max_tokens=5)),
             "o": ([1, 5, 9], SamplingParams(max_tokens=5, temperature=0.8, seed=1))}
    assert generate(screened, mixed) == generate(plain, mixed)
    assert screen.recomputed == before
    assert screened.blocks.num_free_blocks == screened.blocks.num_blocks


def test_screen_stops_where_it_recomputes_too_many_logits(lib, tiny_model):
    check_stops(engine(tiny_model, "on", "bfloat16"), engine(tiny_model, "off", "bfloat16"), 4)


def test_screen_on_for_a_bf16_model_needs_the_native_gemm(lib, tiny_model):
    with pytest.raises(RuntimeError, match="greedy_screen: on needs, for a bfloat16 model"):
        InflightEngine(EngineConfig(checkpoint=tiny_model, dtype="bfloat16", num_kv_blocks=64,
                                    linear_backend="torch", greedy_screen="on"))
