"""The torch side of a step: the model runners (reference and `gpu` fast path), the sampler and
the KV-cache tensor."""
