"""CPU weight layout: linear layers keep their weight transposed, (in_features, out_features) contiguous.

MKL's GEMM for the few rows of a decode step (M = 1..64) runs up to 2x faster when the weight is the
row-major right operand (`x @ W^T` with W^T stored) than with nn.Linear's (out, in) layout; for prefill-sized
M both layouts run at the same speed. CUDA GEMMs are indifferent, so only CPU models are converted.
"""
from __future__ import annotations

import torch
from torch import nn


class InputMajorLinear(nn.Module):
    """y = x @ weight_t + bias, with weight_t = linear.weight.T stored contiguously."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight_t).view(*x.shape[:-1], -1)


def use_input_major_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (in place) by an InputMajorLinear; tied weights get their own copy."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, InputMajorLinear(child))
        else:
            use_input_major_linears(child)
    return model
