"""inflight: an in-flight batching LLM backend for NVIDIA Triton Inference Server."""
