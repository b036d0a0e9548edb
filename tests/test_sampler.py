import math

import numpy as np
import pytest
import torch

from inflight_backend.request import SamplingParams
from inflight_backend.sampler import Sampler, filter_probs, mask_logits, non_finite_rows


def test_top_k_and_top_p_keep_only_the_best_tokens():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert (filter_probs(logits[None], [2], [1.0])[0] > 0).tolist() == [False, True, True, False]
    probs = filter_probs(logits[None], [0], [0.5])[0]
    assert (probs > 0).tolist() == [False, True, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(8, temperature=1.0, seed=11), SamplingParams(8), SamplingParams(8, temperature=2.0,
                                                                                            seed=5)]
    first = [Sampler().sample(logits, ["a", "b", "c"], params) for _ in range(2)]
    assert first[0] == first[1] and first[0][1] == {}
    assert first[0][0][1] == int(logits[1].argmax())
    draws = {tuple(Sampler().sample(logits, ["a"], [SamplingParams(8, temperature=5.0, seed=s)])[0])
             for s in range(20)}
    assert len(draws) > 1  # different seeds give different tokens


@pytest.mark.parametrize("temperature", [1e-5, 1.5e-5, 1e-3])
def test_small_temperatures_sample_the_best_token_without_failing(temperature):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 30
    params = [SamplingParams(8, temperature=temperature, seed=i) for i in range(4)]
    tokens, failed = Sampler().sample(logits, list("abcd"), params)
    assert failed == {} and tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-40, 1e-45])
def test_temperatures_below_the_greedy_bound_are_greedy(temperature):
    assert SamplingParams(8, temperature=temperature).greedy
    assert not SamplingParams(8, temperature=1e-5).greedy


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_that_cannot_be_sampled_fails_alone(bad, greedy):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = bad
    params = [SamplingParams(8, temperature=0.0 if greedy else 0.7, seed=3) for _ in range(3)]
    tokens, failed = Sampler().sample(logits, list("abc"), params)
    if bad == -math.inf and greedy:  # a -inf logit is never chosen: the row is still well defined
        assert failed == {} and tokens[1] == int(logits[1].argmax())
        return
    if bad == -math.inf:  # sampling: a -inf logit has probability 0, the row samples normally
        assert failed == {} and tokens[1] != 7
        return
    assert set(failed) == {1} and tokens[1] == -1 and "non-finite" in failed[1]
    assert min(tokens[0], tokens[2]) >= 0
    if greedy:
        assert [tokens[0], tokens[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


def test_a_step_that_samples_no_row_returns_nothing():
    assert Sampler().sample(torch.empty(0, 50), [], []) == ([], {})


@pytest.mark.parametrize("layout", ["float32", "bfloat16", "transposed"])
def test_masks_set_exactly_the_given_cells_to_minus_infinity(layout):
    """The numpy path (float32 on the CPU, any strides) and torch's (any other) mask the same cells, repeats
    included, and nothing else."""
    with torch.inference_mode():  # as the runner's logits are
        base = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
        logits = {"float32": base.clone(), "bfloat16": base.to(torch.bfloat16),
                  "transposed": base.t().contiguous().t()}[layout]
        mask_logits(logits, [0, 0, 4, 5, 5], [7, 39, 0, 2, 2])
    masked = {(r, c) for r, c in torch.isneginf(logits).nonzero().tolist()}
    assert masked == {(0, 7), (0, 39), (4, 0), (5, 2)}
    keep = ~torch.isneginf(logits)
    assert torch.equal(logits[keep].float(), base.to(logits.dtype)[keep].float())


@pytest.mark.parametrize("layout", ["float32", "bfloat16", "transposed"])
def test_non_finite_chosen_logits_are_found_on_either_path(layout):
    base = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    base[1, 3], base[3, 9], base[4, 0] = math.nan, math.inf, math.nan
    logits = {"float32": base, "bfloat16": base.to(torch.bfloat16), "transposed": base.t().contiguous().t()}[layout]
    assert non_finite_rows(logits, [3, 3, 0, 9, 1]) == [1, 3]  # row 4's NaN is not the chosen one
    assert non_finite_rows(logits, [0, 0, 0, 0, 2]) == []


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The filters over a full sort, one row (as written when filter_probs took one row at a time); min_p as
    vLLM's MinPLogitsProcessor: probabilities below min_p times the largest dropped, before the others."""
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    sorted_logits, order = torch.sort(logits, descending=True)
    if top_k > 0:
        sorted_logits[top_k:] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= top_p, 0.0)
        probs = probs / probs.sum()
    return torch.zeros_like(probs).scatter_(0, order, probs)


# Peaked rows (the nucleus in the first 64 tokens) and flat ones (it takes several widenings, or the whole sort);
# a masked token; top-k larger than the vocabulary.
@pytest.mark.parametrize("spread", [0.05, 1.0, 8.0])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (40, 0.8), (5000, 0.95), (0, 0.999)])
def test_filters_keep_the_same_tokens_and_mass_as_a_full_sort(spread, top_k, top_p):
    logits = (torch.randn(3000, generator=torch.Generator().manual_seed(int(spread * 10) + top_k)) * spread).double()
    logits[17] = float("-inf")
    got, want = filter_probs(logits[None], [top_k], [top_p])[0], reference_filter(logits.clone(), top_k, top_p)
    shifted = logits - logits.max()  # min_p as filter_probs reads it: of `scale`'s rows, the best at 0
    for min_p in (0.01, 0.3):
        got_p, want_p = filter_probs(shifted[None], [top_k], [top_p], [min_p])[0], reference_filter(
            shifted.clone(), top_k, top_p, min_p)
        assert torch.equal(got_p > 0, want_p > 0)
        torch.testing.assert_close(got_p, want_p, rtol=1e-9, atol=1e-12)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_draw_never_takes_a_zero_weight_and_follows_the_weights():
    from inflight_backend.sampler import draw

    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]], dtype=torch.float64).expand(4000, 5)
    uniform = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(torch.tensor(draw(weights, uniform)), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    assert 0.22 < counts[1] / 4000 < 0.28  # 1/4, the binomial spread ~0.007
    edges = draw(weights[:4], torch.tensor([0.0, 0.25, 1 - 2 ** -52, 1.0], dtype=torch.float64))
    assert edges == [1, 3, 3, 3]  # a draw at a boundary takes the next positive weight; at the total, the last
    bad = torch.tensor([[0.0, 0.0], [0.5, float("nan")], [1.0, -0.5], [0.2, 0.8]], dtype=torch.float64)
    assert draw(bad, torch.full((4,), 0.5, dtype=torch.float64)) == [-1, -1, -1, 1]


def native_lib():
    from inflight_backend.models import cpu_ops

    lib = cpu_ops.load_library()
    if lib is None:
        pytest.fail("build/lib/libinflight_ops_cpu.so is missing: run `make native`")
    return lib


# The native draw (ops_sample_rows_f32, the CPU path of Sampler.sample for fp32 logits) against the torch one:
# for each uniform u, the token must be one whose interval of the reference's running mass holds u (within the
# fp32 weights' rounding) and never one the reference's filters drop.
@pytest.mark.parametrize("spread", [0.05, 1.0, 8.0])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (40, 0.8), (5000, 0.95),
                                          (0, 0.999), (0, 1e-6), (2999, 1.0), (3000, 0.5)])
@pytest.mark.parametrize("temperature, min_p", [(0.7, 0.0), (1.3, 0.0), (1.3, 0.02), (0.7, 0.5)])
def test_native_draws_follow_the_reference_filters(spread, top_k, top_p, temperature, min_p):
    from inflight_backend.models import cpu_ops

    logits = torch.randn(3000, generator=torch.Generator().manual_seed(int(spread * 10) + top_k)) * spread
    logits[17] = float("-inf")
    want = reference_filter((logits.double() - logits.max().double()) / temperature, top_k, top_p, min_p)
    cdf = torch.cumsum(want, dim=0)
    uniform = [i / 257 for i in range(257)] + [1 - 2 ** -40]
    rows = [0] * len(uniform)
    got = cpu_ops.sample_rows(native_lib(), logits.view(1, -1), rows, [temperature] * len(rows), [top_k] * len(rows),
                              [top_p] * len(rows), uniform, [min_p] * len(rows))
    for u, token in zip(uniform, got):
        assert want[token] > 0, (u, token)
        low, high = float(cdf[token] - want[token]), float(cdf[token])
        assert low - 1e-5 <= u <= high + 1e-5, (u, token, low, high)


def test_native_rows_do_not_depend_on_the_batch():
    """A row's token is the same sampled alone or among others (other params, other rows, any order)."""
    from inflight_backend.models import cpu_ops

    logits = torch.randn(17, 5000, generator=torch.Generator().manual_seed(5)) * 3
    params = [(0.5 + 0.1 * r, [0, 3, 50][r % 3], [1.0, 0.9, 0.5][r % 2], (r * 37 % 101) / 101) for r in range(17)]
    alone = [cpu_ops.sample_rows(native_lib(), logits, [r], [t], [k], [p], [u])[0]
             for r, (t, k, p, u) in enumerate(params)]
    order = list(reversed(range(17)))
    together = cpu_ops.sample_rows(native_lib(), logits, order, *(list(x) for x in zip(*(params[r] for r in order))))
    assert together == [alone[r] for r in order]


def test_native_rows_without_mass_fail_alone():
    from inflight_backend.models import cpu_ops

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    logits[0, 3], logits[1, 9], logits[2] = math.nan, math.inf, float("-inf")
    got = cpu_ops.sample_rows(native_lib(), logits, [0, 1, 2, 3], [1.0] * 4, [0] * 4, [1.0] * 4, [0.5] * 4)
    assert got[:3] == [-1, -1, -1] and 0 <= got[3] < 64
    with pytest.raises(RuntimeError, match="sample_rows failed"):  # a uniform outside [0, 1): refused
        cpu_ops.sample_rows(native_lib(), logits, [3], [1.0], [0], [1.0], [1.0])


def test_sampler_takes_the_native_path_on_cpu_and_the_torch_one_elsewhere_alike():
    """The same seeds through Sampler (native: fp32 CPU logits) and the torch path (float64 logits here): the
    same uniforms, so the same tokens but where the two roundings straddle a boundary (none in these draws)."""
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(7)) * 2
    params = [SamplingParams(8, temperature=0.8, top_k=[0, 20][i % 2], top_p=[1.0, 0.9, 0.6][i % 3], seed=i,
                             min_p=[0.0, 0.1][i // 3]) for i in range(6)]
    native, _ = Sampler().sample(logits, list("abcdef"), params)
    reference, _ = Sampler().sample(logits.double(), list("abcdef"), params)
    assert native == reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["numpy", "torch"])
def test_penalty_state_folds_tokens_in_as_they_come_and_penalizes_as_a_recount_would(dtype):
    """Step by step, the state updated a token at a time gives the rows a recount of prompt and output gives
    (repetition over their union, presence and frequency over the output's counts), bitwise: fp32 CPU rows through
    numpy, others (float64 here, as a GPU's) through torch all at once."""
    from inflight_backend.sampler import PenaltyState, apply_penalties

    rng = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 50, (30,), generator=rng).tolist()
    p = SamplingParams(8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    other = SamplingParams(8, repetition_penalty=0.7)  # a second request in the same step
    state, output, other_state = PenaltyState(60, prompt, p), [], PenaltyState(60, [3, 3, 9], other)
    for step in range(12):
        logits = (torch.randn(3, 60, generator=rng) * 3).to(dtype)
        want = logits[1].clone()
        want_other = logits[2].clone()
        want_other[[3, 9]] = torch.where(want_other[[3, 9]] < 0, want_other[[3, 9]] * 0.7, want_other[[3, 9]] / 0.7)
        seen = sorted(set(prompt) | set(output))
        want[seen] = torch.where(want[seen] < 0, want[seen] * 1.3, want[seen] / 1.3)
        for token in sorted(set(output)):
            want[token] -= torch.tensor(0.4, dtype=dtype) + torch.tensor(0.25, dtype=dtype) * float(output.count(token))
        state.update(output)
        untouched = logits[0].clone()
        apply_penalties(logits, [1, 2], [state, other_state], [p, other])
        assert torch.equal(logits[1], want) and torch.equal(logits[2], want_other), step
        assert torch.equal(logits[0], untouched)
        output += torch.randint(0, 60, (step % 3,), generator=rng).tolist()  # 0, 1 or 2 tokens a step


def reference_info(raw: torch.Tensor, token: int, k: int) -> tuple[float, list[int], list[float]]:
    logprobs = torch.log_softmax(raw, dim=-1)
    values, ids = torch.topk(logprobs, k)
    return float(logprobs[token]), ids.tolist(), values.tolist()


@pytest.mark.parametrize("top", [0, 1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["native", "torch"])
def test_logprobs_match_torch_log_softmax_and_topk(top, dtype):
    """token_infos (fp32 CPU rows: ops_logprobs_rows_f32; others, float64 here as a GPU's: torch over every row
    at once) against torch's log_softmax and topk row by row: the chosen token's log-probability, the top tokens
    and theirs; a row with NaN: NaN, as torch's; raw logits where asked, and nothing where not asked."""
    from inflight_backend.token_rules import token_infos

    raw = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(top)) * 4).to(dtype)
    raw[2, 11] = float("-inf")
    raw[4, 7] = math.nan
    tokens = [5, 17, 11, 2999, 0, 123]
    params = [SamplingParams(8, logprobs=None if i == 5 else top, return_generation_logits=i == 1) for i in range(6)]
    got = token_infos(raw, tokens, params)
    assert got[5].logprob is None and got[5].top == () and got[5].logits is None
    assert np.array_equal(got[1].logits, raw[1].numpy()) and got[0].logits is None
    for row in range(5):
        logprob, ids, values = reference_info(raw[row].clone(), tokens[row], top)
        if row == 4:
            assert math.isnan(got[row].logprob) and math.isnan(logprob)
            continue
        assert got[row].logprob == pytest.approx(logprob, abs=1e-5)
        assert [t for t, _ in got[row].top] == ids
        assert [v for _, v in got[row].top] == pytest.approx(values, abs=1e-5)
    assert got[2].logprob == float("-inf")  # a masked token: log-probability -inf, as torch's


def test_the_torch_path_samples_a_batch_as_its_rows_alone():
    """Logits the native draw does not take (bfloat16 here; a GPU's) go through filter_probs and draw for the
    whole batch at once: each row's token is the one it gets alone, for every filter."""
    logits = (torch.randn(6, 700, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    params = [SamplingParams(8, temperature=0.9, top_k=[0, 7, 50][i % 3], top_p=[1.0, 0.8][i % 2], seed=i)
              for i in range(6)]
    together, failed = Sampler().sample(logits, list("abcdef"), params)
    alone = [Sampler().sample(logits[i:i + 1], ["abcdef"[i]], [params[i]])[0][0] for i in range(6)]
    assert failed == {} and together == alone
