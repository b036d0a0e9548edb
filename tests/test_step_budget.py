"""The step time target's budget (inflight_backend/step_budget.py): the fit, its floor and ceiling, adaptation."""
import random

import pytest

from inflight_backend.step_budget import StepBudget


def test_the_ceiling_until_steps_of_different_sizes_were_seen():
    budget = StepBudget(0.1, ceiling=512, min_prompt_tokens=16)
    assert budget.budget(8) == 512
    for _ in range(50):
        budget.observe(40, 0.2)  # one size only: no cost per token can be told apart from the fixed cost
    assert budget.per_token_s is None and budget.budget(8) == 512


def run_steps(budget: StepBudget, rng: random.Random, steps: int, per_token_s: float) -> None:
    """Steps of 1-300 tokens costing 20 ms plus `per_token_s` a token."""
    for _ in range(steps):
        tokens = rng.randint(1, 300)
        budget.observe(tokens, 0.02 + per_token_s * tokens)


def test_a_linear_cost_is_learnt_and_the_budget_meets_the_target():
    budget = StepBudget(0.1, ceiling=512, min_prompt_tokens=16)
    run_steps(budget, random.Random(0), 30, 0.001)
    assert budget.per_token_s == pytest.approx(0.001) and budget.fixed_s == pytest.approx(0.02)
    assert budget.budget(8) == 80  # (0.1 - 0.02) / 0.001
    assert budget.budget(70) == 86  # 70 running: their decodes and one block of prompt
    assert budget.budget(600) == 512  # never above the ceiling


def test_the_fit_follows_a_machine_that_slows_down():
    budget = StepBudget(0.1, ceiling=512, min_prompt_tokens=16)
    rng = random.Random(1)
    run_steps(budget, rng, 30, 0.001)
    assert budget.budget(8) == 80
    run_steps(budget, rng, 200, 0.002)  # every token now costs twice as much
    assert budget.budget(8) == 40


def test_a_window_that_fits_no_positive_cost_keeps_the_last_one():
    budget = StepBudget(0.1, ceiling=512, min_prompt_tokens=16, forget=0.01)  # the last two steps decide
    budget.observe(10, 0.03)
    budget.observe(100, 0.12)
    assert budget.per_token_s == pytest.approx(0.001)
    budget.observe(200, 0.05)  # a larger step measured faster (another process had slowed the last one)
    assert budget.per_token_s == pytest.approx(0.001)
    budget.observe(150, 0.5)  # the machine slowed: the fixed cost alone is over the target now
    assert budget.budget(4) == 20  # the decodes (4) and one block of prompt


@pytest.mark.parametrize("args", [(0.0, 512, 16), (0.1, 0, 16), (0.1, 512, 0)])
def test_nonsense_settings_are_refused(args):
    with pytest.raises(ValueError):
        StepBudget(*args)
