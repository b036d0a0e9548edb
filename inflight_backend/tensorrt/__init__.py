"""The TensorRT engine: ONNX export of the packed, paged model with one PagedAttention node per layer."""
