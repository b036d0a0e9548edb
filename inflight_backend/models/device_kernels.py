"""Which kernels a loaded model computes with on its device, chosen once after loading (checkpoint.py only
loads weights). On the CPU: the linear layers' layout (cpu_layout.py) and, with the native one, the ops fused
between them (cpu_ops.py) and the whole layer stack in one call (decoder_stack.py); elsewhere torch's own
modules, with the q/k/v and gate/up projections merged, and on CUDA with `cuda_fused_ops` the ops between them
fused (cuda_ops.py)."""
from __future__ import annotations

import torch

from . import cpu_ops, cuda_ops, decoder_stack, skinny_gemm
from . import greedy_screen as greedy_screen_module
from .cpu_layout import PackedBf16Linear, PackedLinear, convert_cpu_linears
from .llama import LlamaForCausalLM, merge_projections


def place(model: LlamaForCausalLM, device: str, linear_backend: str = "auto",
          amx_gemm: str = "auto", greedy_screen: str = "auto", cuda_fused_ops: str = "off") -> LlamaForCausalLM:
    """Convert `model` (in place, in the dtype its weights were loaded in) for `device` and move it there, in
    eval mode; `model.linear_layout` names the choice."""
    if torch.device(device).type != "cuda" and cuda_fused_ops == "on":
        raise RuntimeError(f"cuda_fused_ops: on applies to CUDA models (device {device}); use auto or off")
    if torch.device(device).type != "cpu" and amx_gemm == "on":
        raise RuntimeError(f"amx_gemm: on applies to CPU models (device {device}); use auto or off")
    if torch.device(device).type != "cpu" and greedy_screen == "on":
        raise RuntimeError(f"greedy_screen: on applies to CPU models (device {device}); use auto or off")
    if torch.device(device).type == "cpu":
        head_weight, sgemm = model.lm_head.weight, skinny_gemm.load_library()
        model.linear_layout = convert_cpu_linears(model, linear_backend, head_weight.dtype, amx_gemm)
        model.greedy_screen = greedy_screen_module.build(sgemm, head_weight, model.lm_head, greedy_screen)
        del head_weight
        if model.greedy_screen is not None:
            model.linear_layout += f", greedy steps' LM head screened in {model.greedy_screen.label}"
        ops = cpu_ops.load_library()
        if isinstance(model.lm_head, (PackedLinear, PackedBf16Linear)) and ops is not None:  # contiguous outputs
            cpu_ops.convert_cpu_ops(model, ops)
            model.linear_layout += " + fused CPU ops"
            # (the stack points at the weights; moving a CPU model to the CPU leaves them where they are)
            if (stack := decoder_stack.build(model)) is not None:
                model.decoder_stack = stack
                model.linear_layout += ", layers in one native call"
        return model.to(device).eval()
    model = model.to(device).eval()
    merge_projections(model)
    model.linear_layout = "torch (nn.Linear, merged qkv and gate/up)"
    if torch.device(device).type == "cuda" and cuda_fused_ops != "off":
        if (lib := cuda_ops.load_library()) is not None:
            cuda_ops.convert_cuda_ops(model, lib)
            model.linear_layout += " + fused CUDA ops"
        elif cuda_fused_ops == "on":
            raise RuntimeError("cuda_fused_ops: on needs build/lib/libinflight_ops_cuda.so, built where nvcc is "
                               "found (make native)")
    return model
