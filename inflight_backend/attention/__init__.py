"""Paged attention behind one interface, so kernels swap without touching the model."""
from .base import AttentionBackend, AttentionMetadata
from .torch_ref import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "make_backend"]


def make_backend(name: str = "torch") -> AttentionBackend:
    if name == "torch":
        return TorchPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
