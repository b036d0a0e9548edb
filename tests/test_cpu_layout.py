"""CPU models keep linear weights transposed (input-major); the result must equal nn.Linear's."""
import pytest
import torch
from torch import nn

from inflight_backend.attention import make_backend
from inflight_backend.checkpoint import load_model
from inflight_backend.models.cpu_layout import InputMajorLinear, use_input_major_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_input_major_linear_equals_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    converted = InputMajorLinear(linear)
    assert converted.weight_t.shape == (96, 160) and converted.weight_t.is_contiguous()
    torch.testing.assert_close(converted(x), linear(x), atol=1e-5, rtol=1e-5)


def test_nested_linears_are_all_converted():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4, bias=False)))
    x = torch.randn(3, 8)
    expected = model(x)
    use_input_major_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected)


def test_cpu_checkpoint_loads_input_major_and_keeps_tied_weights(tied_model):
    model = load_model(tied_model, make_backend("torch", torch.device("cpu")), torch.float32, "cpu")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # tied embeddings: the LM head is the embedding matrix, transposed
    torch.testing.assert_close(model.lm_head.weight_t, model.model.embed_tokens.weight.t())
