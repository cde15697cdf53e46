"""The model runner on a tiny float64 Llama: speculative verification, seeded sampling, logprobs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY, parity_model
from tests.model.driver import Sampling, TestDriver

VOCAB = PARITY.vocab_size


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = parity_model("llama", seed=11).save(directory)
    model.config._attn_implementation = "sdpa"
    return directory, model


def _runner(directory: Path, block_size: int = 4) -> ModelRunner:
    return ModelRunner(
        EngineConfig(model=str(directory), dtype="float64", block_size=block_size, num_kv_blocks=300)
    )


def _prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def test_speculative_drafts_are_verified_without_changing_greedy_output(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    prompts = _prompts(6)
    new_tokens = [12] * len(prompts)
    plain = [s.tokens for s in TestDriver(_runner(directory), 32, 6).generate(prompts, new_tokens)]

    calls = {"n": 0}

    def oracle_with_mistakes(tokens: list[int]) -> list[int]:
        full = next(t for t in plain if t[: len(tokens)] == tokens)
        drafts = full[len(tokens) : len(tokens) + 3]
        calls["n"] += 1
        if calls["n"] % 2 and len(drafts) >= 2:
            drafts[1] = (drafts[1] + 1) % VOCAB  # a wrong second draft: accept one, then correct
        return drafts

    driver = TestDriver(_runner(directory), 32, 6, drafter=oracle_with_mistakes)
    speculative = [s.tokens for s in driver.generate(prompts, new_tokens)]
    assert speculative == plain
    assert 0 < driver.stats.drafts_accepted < driver.stats.drafts_proposed


def test_seeded_sampling_ignores_batching_chunking_and_speculation(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    prompts = _prompts(6, seed=8)
    new_tokens = [10] * len(prompts)
    sampling = [Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i) for i in range(len(prompts))]
    wide = TestDriver(_runner(directory), 64, 6).generate(prompts, new_tokens, sampling)
    narrow = TestDriver(_runner(directory, block_size=8), 7, 2).generate(prompts, new_tokens, sampling)

    def random_drafts(tokens: list[int]) -> list[int]:
        rng = random.Random(len(tokens))
        return [rng.randrange(VOCAB) for _ in range(2)]

    drafted = TestDriver(_runner(directory), 64, 3, drafter=random_drafts).generate(
        prompts, new_tokens, sampling
    )
    assert [s.outputs for s in wide] == [s.outputs for s in narrow] == [s.outputs for s in drafted]
    greedy = TestDriver(_runner(directory), 64, 6).generate(prompts, new_tokens)
    assert [s.outputs for s in wide] != [s.outputs for s in greedy]


def test_logprobs_match_the_reference_distribution(tiny_llama: tuple[Path, Any]) -> None:
    directory, reference = tiny_llama
    prompt = _prompts(1, seed=3)[0]
    seq = TestDriver(_runner(directory), 16, 1).generate([prompt], [1], [Sampling(num_logprobs=3)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = expected.topk(3)
    entry = seq.logprobs[0]
    assert entry[0][0] == seq.outputs[0] == int(top.indices[0])
    assert [t for t, _ in entry[1:]] == top.indices.tolist()
    np.testing.assert_allclose([lp for _, lp in entry[1:]], top.values.tolist(), rtol=0, atol=1e-10)


def test_a_step_without_sampling_rows_returns_no_tokens(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    runner = _runner(directory)
    step = SchedulerOutput(
        step_id=41,
        req_ids=[0],
        num_decode_rows=0,
        query_lens=np.array([3], np.int32),
        query_start_loc=np.array([0, 3], np.int32),
        num_computed_tokens=np.array([0], np.int32),
        seq_lens=np.array([3], np.int32),
        input_ids=np.array([5, 6, 7], np.int64),
        positions=np.array([0, 1, 2], np.int64),
        slot_mapping=np.array([4, 5, 6], np.int64),
        block_tables=np.array([[1]], np.int32),
        logits_indices=np.array([], np.int64),
        sample_rows=np.array([], np.int32),
        num_draft_tokens=np.array([0], np.int32),
        sampling=SamplingBatch(
            temperature=np.zeros(1, np.float32),
            top_p=np.ones(1, np.float32),
            top_k=np.full(1, -1, np.int32),
            seeds=np.full(1, -1, np.int64),
            output_positions=np.zeros(1, np.int32),
            num_logprobs=np.full(1, -1, np.int32),
            all_greedy=True,
        ),
    )
    out = runner.execute(step)
    assert out.step_id == 41 and out.sampled_token_ids == [] and out.logprobs is None
    assert torch.isfinite(runner.kv_cache[:, :, 1, :3]).all()


def test_a_step_without_drafts_returns_its_tokens_as_one_array(tiny_llama: tuple[Path, Any]) -> None:
    """The runners' form for steps without drafts (what `Scheduler.postprocess` reads without a
    per-row pass): one token per sampling row in `sampled_token_array`, no per-row lists."""
    directory, model = tiny_llama
    runner = _runner(directory)
    prompts = [[5, 6, 7], [9, 8]]
    step = SchedulerOutput(
        step_id=7,
        req_ids=[0, 1],
        num_decode_rows=0,
        query_lens=np.array([3, 2], np.int32),
        query_start_loc=np.array([0, 3, 5], np.int32),
        num_computed_tokens=np.array([0, 0], np.int32),
        seq_lens=np.array([3, 2], np.int32),
        input_ids=np.array([5, 6, 7, 9, 8], np.int64),
        positions=np.array([0, 1, 2, 0, 1], np.int64),
        slot_mapping=np.array([4, 5, 6, 8, 9], np.int64),
        block_tables=np.array([[1], [2]], np.int32),
        logits_indices=np.array([2, 4], np.int64),
        sample_rows=np.array([0, 1], np.int32),
        num_draft_tokens=np.array([0, 0], np.int32),
        sampling=SamplingBatch(
            temperature=np.zeros(2, np.float32),
            top_p=np.ones(2, np.float32),
            top_k=np.full(2, -1, np.int32),
            seeds=np.full(2, -1, np.int64),
            output_positions=np.zeros(2, np.int32),
            num_logprobs=np.full(2, -1, np.int32),
            all_greedy=True,
        ),
    )
    out = runner.execute(step)
    with torch.no_grad():
        want = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert out.sampled_token_ids == [] and out.sampled_token_array is not None
    assert out.sampled_token_array.dtype == np.int64 and out.sampled_token_array.tolist() == want
    assert out.tokens_per_row() == [[t] for t in want]


def test_blocks_moved_to_another_runner_continue_the_same_sequence(tiny_llama: tuple[Path, Any]) -> None:
    # What a P/D hand-off does: copy a prefilled sequence's blocks into another engine's cache
    # (at other block ids) and continue decoding there.
    directory, _ = tiny_llama
    prompt = _prompts(1, seed=21)[0] + _prompts(1, seed=22)[0]
    expected = TestDriver(_runner(directory), 64, 1).generate([prompt], [6])[0].outputs

    producer_driver = TestDriver(_runner(directory), 64, 1)
    first = producer_driver.generate([prompt], [1])[0]
    data = producer_driver.runner.read_blocks(first.blocks)
    assert data.shape == (3, 2, len(first.blocks), 4, 2, 16)

    consumer = _runner(directory)
    consumer_blocks = [50 + 2 * i for i in range(len(first.blocks))]
    consumer.write_blocks(consumer_blocks, data)
    assert torch.equal(consumer.read_blocks(consumer_blocks), data)
    with pytest.raises(ValueError, match="expected"):
        consumer.write_blocks(consumer_blocks[:1], data)

    driver = TestDriver(consumer, 64, 1)
    driver.next_block = 50 + 2 * len(first.blocks)
    for index, block in enumerate(consumer_blocks):
        driver.prefix_blocks[tuple(prompt[: (index + 1) * 4])] = block
    continued = driver.generate([prompt], [6])[0]
    assert driver.stats.prefix_hit_tokens == ((len(prompt) - 1) // 4) * 4
    assert continued.outputs == expected
    assert continued.outputs[0] == first.outputs[0]


def test_a_preloaded_model_must_match_the_configured_dtype(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    loaded = _runner(directory).loaded
    with pytest.raises(
        ValueError, match="preloaded model is torch.float64 on cpu, but the engine is configured"
    ):
        ModelRunner(EngineConfig(model=str(directory), dtype="float32", num_kv_blocks=4), loaded=loaded)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        ModelRunner(EngineConfig(model=str(directory), dtype="float64", num_kv_blocks=4), loaded, "flash")


def test_adaptive_cpu_threads_change_no_greedy_token(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    prompts = _prompts(2, seed=13)
    new_tokens = [16, 16]
    torch.set_num_threads(2)  # the chooser acts only with more than one thread (the fixture restores 1)

    def run(adaptive: bool) -> tuple[list[list[int]], ModelRunner]:
        config = EngineConfig(
            model=str(directory),
            dtype="float64",
            block_size=4,
            num_kv_blocks=300,
            cpu_adaptive_threads=adaptive,
        )
        runner = ModelRunner(config)
        return [s.tokens for s in TestDriver(runner, 32, 2).generate(prompts, new_tokens)], runner

    fixed, fixed_runner = run(adaptive=False)
    adaptive, adaptive_runner = run(adaptive=True)
    assert fixed_runner.step_threads is None
    chooser = adaptive_runner.step_threads
    assert chooser is not None and chooser.all_threads == 2
    assert chooser.chosen(2) in (1, 2)  # the two-row decode steps ran on both counts and picked one
    assert torch.get_num_threads() == 2  # every step gives its threads back
    assert adaptive == fixed
