"""Model definitions over packed (unpadded) tokens with a paged KV cache."""
