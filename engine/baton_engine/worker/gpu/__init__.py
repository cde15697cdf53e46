"""The GPU fast path: the Triton forward (`fused_decoder`), captured decode and verify graphs
(`model_runner`, `verify_batch`) and the step run ahead (`decode_ahead`)."""
