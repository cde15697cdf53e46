"""Quantized weights and KV cache: FP8 formats, scales, and the linear methods that use them."""
