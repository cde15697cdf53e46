"""Greedy parity with transformers `generate()` on tiny random float64 models, via the runner."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY, hf_greedy, parity_model
from tests.model.driver import TestDriver

VOCAB = PARITY.vocab_size


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(VOCAB) for _ in range(23)]
    prompts: list[list[int]] = []
    for length in (1, 2, 3, 5, 8, 13, 21, 34, 47, 60):
        prompts.append([rng.randrange(VOCAB) for _ in range(length)])
    for tail in (1, 4, 9, 17, 30):
        prompts.append(shared + [rng.randrange(VOCAB) for _ in range(tail)])
    prompts.append(list(shared))  # the shared prefix alone
    prompts.append(prompts[9][:40] + [7, 8, 9])  # shares blocks with an earlier long prompt
    prompts.append(list(prompts[3]))  # an exact duplicate
    new_tokens = [4 + (i * 5) % 13 for i in range(len(prompts))]
    return prompts, new_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_greedy_tokens_match_transformers_float64(family: str, tmp_path: Path) -> None:
    reference = parity_model(family, seed=3).save(tmp_path)
    reference.config._attn_implementation = "sdpa"
    prompts, new_tokens = _prompts()
    expected = [hf_greedy(reference, p, n) for p, n in zip(prompts, new_tokens, strict=True)]

    config = EngineConfig(model=str(tmp_path), dtype="float64", block_size=4, num_kv_blocks=400)
    runner = ModelRunner(config)
    driver = TestDriver(runner, max_num_batched_tokens=24, max_num_seqs=6)
    got = [seq.outputs for seq in driver.generate(prompts, new_tokens)]

    assert len(prompts) >= 16
    assert driver.stats.prefix_hit_tokens > 0
    assert driver.stats.chunked_prefill_rows > 0
    assert driver.stats.mixed_steps > 0
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert mismatches == [], [(i, got[i], expected[i]) for i in mismatches]


def test_runner_reports_model_dtype_and_cache_layout(tmp_path: Path) -> None:
    parity_model("qwen3").save(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float64", block_size=8, num_kv_blocks=7))
    assert runner.kv_cache.shape == (3, 2, 7, 8, 2, 32)
    assert runner.kv_cache.dtype == torch.float64
    assert runner.model_config.tie_word_embeddings is True
    assert runner.model_config.qk_norm is True
