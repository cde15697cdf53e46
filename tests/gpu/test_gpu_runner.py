"""The GPU runner (Triton kernels + captured graphs) against the reference runner on the same GPU.

Runs only where CUDA (or ROCm) torch sees a device; CI has none, the device machine runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.llm import LLM
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY, SPECULATIVE, parity_model

VOCAB = PARITY.vocab_size

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _prompts() -> list[list[int]]:
    gen = np.random.default_rng(11)
    shared = gen.integers(0, VOCAB, size=40).tolist()
    return [
        shared + [5, 6, 7],  # these two share 40 tokens: the second hits the prefix cache
        shared + [8],
        gen.integers(0, VOCAB, size=150).tolist(),  # chunked over several steps
        gen.integers(0, VOCAB, size=3).tolist(),
        gen.integers(0, VOCAB, size=21).tolist(),
    ]


def _llm(model_dir: Path, fast: bool, monkeypatch: pytest.MonkeyPatch) -> LLM:
    monkeypatch.setenv("BATON_GPU_FAST_PATH", "1" if fast else "0")
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=48,
        block_size=16,
        num_kv_blocks=64,
    )
    if fast:
        assert isinstance(llm.core.runner, GpuModelRunner)
        llm.core.runner.sync_debug = True  # every device step under set_sync_debug_mode("error")
    else:
        assert type(llm.core.runner) is ModelRunner
    return llm


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_path_matches_reference_runner(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parity_model(family).save(tmp_path / family)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    prompts = _prompts()
    prompts = prompts + [prompts[3]]
    params = [greedy] * (len(prompts) - 1) + [seeded]
    reference = _generate(_llm(tmp_path / family, False, monkeypatch), prompts, params)
    fast = _generate(_llm(tmp_path / family, True, monkeypatch), prompts, params)
    assert fast == reference
    assert [len(t) for t in fast] == [20, 20, 20, 20, 20, 12]


def test_decode_ahead_matches_reference_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parity_model("llama").save(tmp_path / "llama")
    gen = np.random.default_rng(12)
    prompts = [gen.integers(0, VOCAB, size=n).tolist() for n in (5, 9, 16, 30, 3)]
    lengths = [3, 17, 40, 25, 33]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    reference_llm = _llm(tmp_path / "llama", False, monkeypatch)
    reference = _generate(reference_llm, prompts, params)
    single_ref = _generate(reference_llm, prompts[2:3], params[2:3])
    fast_llm = _llm(tmp_path / "llama", True, monkeypatch)
    runner = fast_llm.core.runner
    assert isinstance(runner, GpuModelRunner)
    assert _generate(fast_llm, prompts, params) == reference
    assert [len(t) for t in reference] == lengths
    hits_batch = runner.ahead_hits
    assert hits_batch > 0
    assert _generate(fast_llm, prompts[2:3], params[2:3]) == single_ref
    assert runner.ahead_hits - hits_batch >= 30  # batch 1, 40 tokens: all but boundary steps


def test_speculative_verify_graphs_match_reference_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify steps replay the captured fixed-query-length graphs; greedy and seeded outputs with
    speculation on equal the reference runner's with it off."""
    # A 16-token vocabulary: random weights then decode in loops that n-gram drafts hit.
    SPECULATIVE.save(tmp_path / "llama")
    gen = np.random.default_rng(13)
    prompts = [gen.integers(0, 16, size=n).tolist() for n in (5, 17, 9, 26)] + [[3, 4, 5] * 6]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    params = [greedy] * 4 + [seeded]
    reference = _generate(_llm(tmp_path / "llama", False, monkeypatch), prompts, params)
    monkeypatch.setenv("BATON_GPU_FAST_PATH", "1")
    spec = LLM(
        str(tmp_path / "llama"),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        block_size=16,
        num_kv_blocks=64,
        speculative="ngram",
        num_speculative_tokens=4,
        ngram_min=1,
        ngram_max=3,
    )
    runner = spec.core.runner
    assert isinstance(runner, GpuModelRunner)
    assert runner.verify_query_lens == (2, 3, 5)
    runner.sync_debug = True
    assert _generate(spec, prompts, params) == reference
    assert runner.verify_graph_steps > 0
    assert spec.core.stats().spec_accepted_tokens > 0
