"""Paged attention behind one interface, so kernels swap without touching the model."""
from __future__ import annotations

import logging

import torch

from ..config import ATTENTION_BACKENDS as BACKENDS
from .base import AttentionBackend, AttentionMetadata
from .kernel_abi import library_path, load_library
from .native import NativePagedAttention
from .torch_ref import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "NativePagedAttention", "TorchPagedAttention", "make_backend"]
log = logging.getLogger("inflight")


def make_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """`torch`: the reference. `native`/`auto`: the kernel library for the device when it is built (see
    plugins/), otherwise the reference with one warning."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return TorchPagedAttention()
    device_type = torch.device(device).type
    lib = load_library(device_type)
    if lib is None:
        log.warning("inflight: %s not built (run `make native`); using the torch reference paged attention",
                    library_path(device_type))
        return TorchPagedAttention()
    log.info("inflight: paged attention: native kernels from %s", library_path(device_type))
    return NativePagedAttention(lib, device_type)
