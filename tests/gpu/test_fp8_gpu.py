"""FP8 on the GPU: the fast path (Triton kernels, captured graphs) against the reference runner,
both with an FP8 KV cache in the device's format.

Runs only where CUDA (or ROCm) torch sees a device; CI has none, the device machine runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.llm import LLM
from baton_engine.model.quantization.fp8 import fp8_dtype_for_device
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_support.tiny_models import PARITY, parity_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

VOCAB = PARITY.vocab_size


def _generate(
    model: Path, fast: bool, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> list[list[int]]:
    monkeypatch.setenv("BATON_GPU_FAST_PATH", "1" if fast else "0")
    llm = LLM(
        str(model), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256,
        max_num_batched_tokens=48, block_size=16, num_kv_blocks=64, **settings,
    )  # fmt: skip
    runner = llm.core.runner
    assert isinstance(runner, GpuModelRunner) == fast
    if isinstance(runner, GpuModelRunner):
        runner.sync_debug = True
    if settings.get("kv_cache_dtype") == "fp8":  # e4m3fnuz on MI300, e4m3fn elsewhere
        assert runner.kv_cache.dtype == fp8_dtype_for_device(torch.device("cuda"))
    gen = np.random.default_rng(21)
    prompts = [gen.integers(0, VOCAB, size=n).tolist() for n in (3, 21, 150, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]


def test_fp8_kv_cache_fast_path_matches_reference_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parity_model("qwen3").save(tmp_path)
    reference = _generate(tmp_path, False, monkeypatch, kv_cache_dtype="fp8")
    fast = _generate(tmp_path, True, monkeypatch, kv_cache_dtype="fp8")
    assert fast == reference


def test_fp8_weights_fast_path_matches_reference_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized on load (`--quantization fp8`): the fused decoder applies the same FP8 linear
    methods as the reference runner, so the greedy tokens are the same, with an FP8 KV cache too."""
    from baton_engine.model.linear import ParallelLinear

    parity_model("qwen3").save(tmp_path)
    for kv in ("auto", "fp8"):
        reference = _generate(tmp_path, False, monkeypatch, quantization="fp8", kv_cache_dtype=kv)
        fast = _generate(tmp_path, True, monkeypatch, quantization="fp8", kv_cache_dtype=kv)
        assert fast == reference, kv
    llm = LLM(
        str(tmp_path), device="cuda", dtype="bfloat16", quantization="fp8", max_num_seqs=4, max_model_len=128,
        block_size=16, num_kv_blocks=16,
    )  # fmt: skip
    try:
        modules = llm.core.runner.model.modules()
        formats = {m.weight.dtype for m in modules if isinstance(m, ParallelLinear)}
    finally:
        llm.close()
    assert formats == {fp8_dtype_for_device(torch.device("cuda"))}
