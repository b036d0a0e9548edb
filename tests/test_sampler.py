import torch

from inflight_backend.request import SamplingParams
from inflight_backend.sampler import Sampler, filter_probs


def test_top_k_and_top_p_keep_only_the_best_tokens():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert (filter_probs(logits.clone(), top_k=2, top_p=1.0) > 0).tolist() == [False, True, True, False]
    probs = filter_probs(logits.clone(), top_k=0, top_p=0.5)
    assert (probs > 0).tolist() == [False, True, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(8, temperature=1.0, seed=11), SamplingParams(8), SamplingParams(8, temperature=2.0,
                                                                                            seed=5)]
    first = [Sampler().sample(logits, ["a", "b", "c"], params) for _ in range(2)]
    assert first[0] == first[1]
    assert first[0][1] == int(logits[1].argmax())
    draws = {tuple(Sampler().sample(logits, ["a"], [SamplingParams(8, temperature=5.0, seed=s)])) for s in range(20)}
    assert len(draws) > 1  # different seeds give different tokens
