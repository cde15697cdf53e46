"""Tensor parallelism on CPU with gloo and real rank processes: the tokens of a split model are the
tokens of one rank (float32 greedy and seeded sampling), through the real scheduler with chunked
prefill, prefix-cache hits, a forced preemption, speculative decoding and KV events; the ranks
load only their shards; bad sizes are refused naming the dimension."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baton_engine import LLM, SamplingParams
from baton_engine.config import EngineConfig
from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput
from baton_engine.entrypoints.engine_factory import build_engine_core, close_runner
from baton_engine.model.parallel import TensorParallelShapeError
from baton_engine.prefix.events import KVCacheEvent
from baton_engine.structured.grammar import json_schema_grammar
from baton_engine.worker import step_message
from baton_engine.worker.distributed import TensorParallelDeviceError, check_devices
from baton_support.tiny_models import CHAT, SPECULATIVE, parity_model
from tests.worker.tp_helpers import live_children

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12, ignore_eos=True)
# Under load a rank may be descheduled for seconds; these tests are not about hangs.
SETTINGS: dict[str, Any] = {"tensor_parallel_timeout_seconds": 300.0}


def _prompts(vocab: int) -> list[list[list[int]]]:
    """Two rounds: the second shares long prefixes with the first (prefix-cache hits); every
    prompt is longer than the step budget (chunked prefill)."""
    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(0, vocab, 24)]
    first = [shared + [int(t) for t in rng.integers(0, vocab, n)] for n in (3, 9, 17)]
    first.append([int(t) for t in rng.integers(0, vocab, 30)])
    second = [shared + [int(t) for t in rng.integers(0, vocab, n)] for n in (5, 11)] + [list(first[3])]
    return [first, second]


def _run(model: Path, tp: int, params: SamplingParams, **settings: Any) -> tuple[list[list[list[int]]], Any]:
    llm = LLM(str(model), tensor_parallel_size=tp, **SETTINGS, **settings)
    try:
        vocab = llm.info.vocab_size
        tokens = [
            [out.outputs[0].token_ids for out in llm.generate(batch, params)] for batch in _prompts(vocab)
        ]
        return tokens, llm.core.stats()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    models = {}
    for family in ("llama", "qwen3"):
        models[family] = root / family
        parity_model(family, seed=5).replace(dtype="float32").save(models[family])
    models["speculative"] = root / "speculative"
    SPECULATIVE.replace(dtype="float32").save(models["speculative"])
    return models


# 20 blocks of 4 tokens: the first round's four requests grow to 47 blocks, so decoding them
# together preempts (recompute) and re-admits; 16-token steps chunk every prompt.
CACHE_PRESSURE: dict[str, Any] = {
    "block_size": 4,
    "num_kv_blocks": 20,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_and_seeded_tokens_at_tp2_equal_one_rank(family: str, tiny_models: dict[str, Path]) -> None:
    model = tiny_models[family]
    for params in (GREEDY, SEEDED):
        want, one_stats = _run(model, 1, params, **CACHE_PRESSURE)
        got, stats = _run(model, 2, params, **CACHE_PRESSURE)
        assert got == want, params
        # The same scheduler decisions, so the same cache behaviour.
        assert stats.num_preemptions == one_stats.num_preemptions > 0
        assert stats.prefix_hit_tokens == one_stats.prefix_hit_tokens > 0
        assert stats.num_steps == one_stats.num_steps


def test_replicated_kv_heads_at_tp4_equal_one_rank(tiny_models: dict[str, Path]) -> None:
    # 4 ranks over 2 KV heads: every head lives on two ranks.
    want, _ = _run(tiny_models["llama"], 1, GREEDY, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    got, _ = _run(tiny_models["llama"], 4, GREEDY, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert got == want


def test_speculative_decoding_and_kv_events_at_tp2_equal_one_rank(tiny_models: dict[str, Path]) -> None:
    def run(tp: int) -> tuple[list[list[int]], list[KVCacheEvent], Any]:
        config = EngineConfig(
            model=str(tiny_models["speculative"]),
            tensor_parallel_size=tp,
            speculative="ngram",
            num_speculative_tokens=3,
            block_size=4,
            kv_events=True,  # recorded for the sink (no publisher is started by the core itself)
            **SETTINGS,
        )
        events: list[KVCacheEvent] = []
        core, info = build_engine_core(config, kv_event_sink=events.extend)
        try:
            prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7 + [5, 6, 7, 8] * 2]
            out: dict[str, list[int]] = {}
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                core.add_request(f"r{i}", prompt, params)
                out[f"r{i}"] = []
            while core.has_unfinished():
                for o in core.step():
                    out[o.request_id].extend(o.new_token_ids)
            return [out["r0"], out["r1"]], events, core.stats()
        finally:
            close_runner(core)

    want, want_events, one = run(1)
    got, got_events, two = run(2)
    assert got == want
    assert two.spec_draft_tokens == one.spec_draft_tokens > 0
    assert two.spec_accepted_tokens == one.spec_accepted_tokens > 0
    # One logical KV-event stream per engine, the same block hashes as one rank's.
    assert got_events == want_events and len(want_events) > 0


POINT: dict[str, Any] = {
    "type": "object",
    "properties": {"x": {"type": "integer", "maximum": 999}, "y": {"type": "integer", "maximum": 999}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


def test_structured_output_at_tp2_masks_rank_zeros_gathered_logits(tmp_path: Path) -> None:
    """Grammar bitmasks are applied to the all-gathered logits on rank 0 (the vocabulary is split
    across ranks before the gather): constrained seeded and greedy answers, with and without
    n-gram drafts, are one rank's and valid; a free request beside them is untouched."""
    model = tmp_path / "chat"
    CHAT.save(model)
    grammar = json_schema_grammar(POINT)
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, grammar=grammar),
        SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar),
        SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
    ]

    def run(tp: int, **settings: Any) -> tuple[list[list[int]], list[str]]:
        options = SETTINGS | settings
        llm = LLM(str(model), tensor_parallel_size=tp, num_kv_blocks=64, max_model_len=256, **options)
        try:
            prompt = llm.tokenizer.encode("Paris is the capital of France.")
            outputs = llm.generate([prompt] * 3, params)
            assert llm.core.stats().num_grammar_requests == 0
            return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in outputs]
        finally:
            llm.close()

    want, texts = run(1)
    for text in texts[:2]:
        assert set(json.loads(text)) == {"x", "y"}, text
    assert run(2) == (want, texts)
    assert run(2, speculative="ngram", num_speculative_tokens=3)[0] == want


@pytest.mark.model
def test_smollm2_splits_three_ways_not_two() -> None:
    """SmolLM2-135M has 9 attention heads over 3 KV heads: 3 ranks split it, 2 cannot."""
    model = "builtin:smollm2-135m-instruct"
    prompts = [[1, 9690, 28, 198, 5248, 314, 253, 1848, 30], [1, 504, 3458, 282, 4649, 314]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(model, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    three = LLM(
        model,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        num_kv_blocks=64,
        tensor_parallel_size=3,
        **SETTINGS,
    )
    try:
        assert [o.outputs[0].token_ids for o in three.generate(prompts, params)] == want
    finally:
        three.close()
    with pytest.raises(TensorParallelShapeError) as info:
        LLM(model, tensor_parallel_size=2)
    assert str(info.value) == (
        "--tensor-parallel-size 2 does not divide the model's 9 attention heads (num_attention_heads)"
    )


def test_sizes_the_model_or_devices_cannot_take_are_refused(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(TensorParallelShapeError) as info:
        LLM(str(tiny_models["llama"]), tensor_parallel_size=3)
    assert str(info.value) == (
        "--tensor-parallel-size 3 does not divide the model's 4 attention heads (num_attention_heads)"
    )
    visible = torch.cuda.device_count()
    with pytest.raises(TensorParallelDeviceError) as device:
        check_devices("cuda:0", visible + 2)
    assert str(device.value) == (
        f"--tensor-parallel-size {visible + 2} needs {visible + 2} GPUs from cuda:0, but {visible} "
        f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
    )
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_step_message_round_trip_cuts_the_block_table() -> None:
    step = SchedulerOutput(
        step_id=7,
        req_ids=[3, 9],
        num_decode_rows=1,
        query_lens=np.array([1, 5], np.int32),
        query_start_loc=np.array([0, 1, 6], np.int32),
        num_computed_tokens=np.array([8, 0], np.int32),
        seq_lens=np.array([9, 5], np.int32),
        input_ids=np.arange(6, dtype=np.int64),
        positions=np.array([8, 0, 1, 2, 3, 4], np.int64),
        slot_mapping=np.arange(10, 16, dtype=np.int64),
        block_tables=np.arange(2 * 64, dtype=np.int32).reshape(2, 64),
        logits_indices=np.array([0, 5], np.int64),
        sample_rows=np.array([0, 1], np.int32),
        num_draft_tokens=np.zeros(2, np.int32),
        sampling=SamplingBatch(
            temperature=np.array([0.0, 0.5], np.float32),
            top_p=np.ones(2, np.float32),
            top_k=np.array([-1, 5], np.int32),
            seeds=np.array([-1, 42], np.int64),
            output_positions=np.array([3, 0], np.int32),
            num_logprobs=np.array([-1, 2], np.int32),
            all_greedy=False,
        ),
        num_prefill_tokens=5,
        num_decode_tokens=1,
        finished_req_ids=[4],
        decode_lookahead=True,
    )
    frames = step_message.encode_step(step, block_size=4)
    assert frames[0] == step_message.STEP
    back = step_message.decode_step([bytes(f) for f in frames[1:]])
    assert back.block_tables.shape == (2, 3)  # ceil(9 / 4) columns are all a row reads
    assert np.array_equal(back.block_tables, step.block_tables[:, :3])
    for name in ("query_lens", "query_start_loc", "seq_lens", "input_ids", "positions", "slot_mapping"):
        assert (
            np.array_equal(getattr(back, name), getattr(step, name)) and getattr(back, name).flags.writeable
        )
    assert np.array_equal(back.sampling.seeds, step.sampling.seeds) and back.sampling.all_greedy is False
    assert (back.step_id, back.req_ids, back.finished_req_ids, back.num_tokens) == (7, [3, 9], [4], 6)
    assert back.decode_lookahead is True


@pytest.fixture(autouse=True)
def _no_rank_left() -> Iterator[None]:
    before = live_children()
    yield
    assert live_children(before) == []
