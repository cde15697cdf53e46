"""Qwen3-MoE and Mixtral on the GPU: the fast path (Triton fused MoE, captured graphs) against
the reference runner, and bfloat16 logits against transformers.

Runs only where CUDA (or ROCm) torch sees a device; CI has none, the device machine runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput
from baton_engine.entrypoints.llm import LLM
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_support.tiny_models import PARITY, TinyModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

VOCAB = PARITY.vocab_size
FAMILIES = ["qwen3_moe", "mixtral"]

#: bfloat16 logits may differ from float32 ones by at most this factor times the difference
#: transformers' own bfloat16 run shows, plus BF16_SLACK of the logits' range: the engine rounds
#: at other points (fused kernels, grouped GEMMs) but must not lose more precision than bf16 does.
BF16_FACTOR = 2.0
BF16_SLACK = 0.01


def _spec(family: str, dtype: str = "float32") -> TinyModel:
    return PARITY.replace(family=family, llama3_rope=False, dtype=dtype, seed=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_matches_reference_runner(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _spec(family).save(tmp_path)
    gen = np.random.default_rng(3)
    prompts = [gen.integers(0, VOCAB, size=n).tolist() for n in (1, 6, 40, 130, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = []
    for fast in (False, True):
        monkeypatch.setenv("BATON_GPU_FAST_PATH", "1" if fast else "0")
        llm = LLM(
            str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256,
            max_num_batched_tokens=64, block_size=16, num_kv_blocks=96,
        )  # fmt: skip
        runner = llm.core.runner
        assert isinstance(runner, GpuModelRunner) == fast
        if fast:
            assert isinstance(runner, GpuModelRunner)
            runner.sync_debug = True  # no host read-back inside a device step (router, top-k, MoE)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))])
    assert outputs[1] == outputs[0]
    assert [len(t) for t in outputs[1]] == [16] * 5


def _prefill_step(prompt: list[int], block_size: int) -> SchedulerOutput:
    """One prefill row of `prompt` in blocks 1, 2, ... with the logits of every position."""
    n = len(prompt)
    blocks = list(range(1, 1 + -(-n // block_size)))
    positions = np.arange(n, dtype=np.int64)
    slots = np.asarray(blocks, dtype=np.int64)[positions // block_size] * block_size + positions % block_size
    return SchedulerOutput(
        step_id=0,
        req_ids=[0],
        num_decode_rows=0,
        query_lens=np.asarray([n], dtype=np.int32),
        query_start_loc=np.asarray([0, n], dtype=np.int32),
        num_computed_tokens=np.asarray([0], dtype=np.int32),
        seq_lens=np.asarray([n], dtype=np.int32),
        input_ids=np.asarray(prompt, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        block_tables=np.asarray([blocks], dtype=np.int32),
        logits_indices=positions,
        sample_rows=np.asarray([0], dtype=np.int32),
        num_draft_tokens=np.asarray([0], dtype=np.int32),
        sampling=SamplingBatch(
            temperature=np.zeros(1, np.float32),
            top_p=np.ones(1, np.float32),
            top_k=np.full(1, -1, np.int32),
            seeds=np.full(1, -1, np.int64),
            output_positions=np.zeros(1, np.int32),
            num_logprobs=np.full(1, -1, np.int32),
            all_greedy=True,
        ),  # fmt: skip
        num_prefill_tokens=n,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_close_to_transformers(family: str, tmp_path: Path) -> None:
    reference = _spec(family).save(tmp_path).to("cuda")
    reference.config._attn_implementation = "sdpa"
    prompt = np.random.default_rng(4).integers(0, VOCAB, size=90).tolist()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        truth = reference(ids).logits[0].float()
        hf_bf16 = reference.to(torch.bfloat16)(ids).logits[0].float()
    runner = GpuModelRunner(
        EngineConfig(
            model=str(tmp_path),
            device="cuda",
            dtype="bfloat16",
            block_size=16,
            num_kv_blocks=16,
            max_num_seqs=4,
            max_model_len=128,
            max_num_batched_tokens=128,
        ),  # fmt: skip
        graph_batch_sizes=(),
    )
    got = runner.compute_logits(_prefill_step(prompt, 16)).float()
    hf_error = (hf_bf16 - truth).abs().max().item()
    engine_error = (got - truth).abs().max().item()
    span = (truth.max() - truth.min()).item()
    bound = BF16_FACTOR * hf_error + BF16_SLACK * span
    assert engine_error <= bound, (engine_error, hf_error, span)
    # and the greedy choice agrees wherever transformers' float32 logits are not a near tie
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(got.argmax(-1)[clear], truth.argmax(-1)[clear])
