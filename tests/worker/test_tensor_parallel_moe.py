"""Mixture-of-experts models under tensor parallelism (CPU, gloo, real rank processes): each rank
holds its shard of every expert's intermediate dimension and the greedy tokens of the split model
are the tokens of one rank (float32), through chunked prefill and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from baton_engine import LLM, SamplingParams
from baton_support.fp8_checkpoints import write_fp8_checkpoint
from baton_support.tiny_models import PARITY

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(model: Path, tp: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, PARITY.vocab_size, 20)]
    prompts = [shared + [int(t) for t in rng.integers(0, PARITY.vocab_size, n)] for n in (2, 7, 13)]
    llm = LLM(
        str(model), tensor_parallel_size=tp, tensor_parallel_timeout_seconds=300.0, dtype="float32",
        block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    try:
        assert llm.core.stats().prefix_hit_tokens == 0
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.stats().prefix_hit_tokens > 0
        return out
    finally:
        llm.close()


CASES = [("qwen3_moe", "16-bit"), ("mixtral", "16-bit"), ("qwen3_moe", "fp8-checkpoint")]


@pytest.mark.parametrize(("family", "weights"), CASES, ids=["-".join(c) for c in CASES])
def test_two_ranks_give_one_ranks_greedy_tokens(family: str, weights: str, tmp_path: Path) -> None:
    """fp8-checkpoint: every expert projection FP8 with one scale per output channel, so each
    rank reads its rows' scales with its rows."""
    model = tmp_path / "16-bit"
    PARITY.replace(family=family, llama3_rope=False, dtype="float32", seed=11).save(model)
    if weights == "fp8-checkpoint":
        model = write_fp8_checkpoint(
            model, tmp_path / "fp8", "compressed-tensors", weight_strategy="channel", activation="none"
        )
    one = _tokens(model, 1)
    assert [len(t) for t in one] == [10, 10, 10]
    assert _tokens(model, 2) == one
