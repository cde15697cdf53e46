"""The scheduler's decode lookahead (`SchedulerOutput.decode_lookahead`): every decode row owns
the block of its next step's token one step early, so the runner's step run ahead
(`decode_ahead.plan_next_decode`) is the next scheduled step also at block boundaries — over
the real scheduler and the paged stand-in model (KV read back through the block tables)."""

from __future__ import annotations

import numpy as np

from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.worker.gpu.decode_ahead import match_rows, plan_next_decode
from tests.core.helpers import assert_no_leaks, check_step_invariants
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token

BS = 4
VOCAB = 40
MAX_LEN = 40


def _scheduler(num_blocks: int, lookahead: bool) -> Scheduler:
    return Scheduler(
        num_blocks=num_blocks, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=MAX_LEN, enable_prefix_caching=False, decode_lookahead=lookahead,
    )  # fmt: skip


def _run(
    scheduler: Scheduler,
    prompts: list[list[int]],
    lengths: list[int],
    model: PagedFakeModel | None = None,
) -> tuple[int, int, list[list[int]]]:
    """Every decode step's prediction against the step scheduled after it: (predictions made,
    predictions matched, generated tokens). `model`: the stand-in whose KV an earlier run left
    (prefix hits read it); None: a fresh one."""
    model = model or PagedFakeModel(scheduler.kv_cache_manager.num_blocks, BS, VOCAB)
    requests = [
        Request(i, list(p), SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    for request in requests:
        scheduler.add(request)
    plan, made, matched, decoding = None, 0, 0, set[int]()
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        check_step_invariants(scheduler, step, decoding)
        if plan is not None:
            index = match_rows(plan, step, BS)
            matched += index is not None
            if index is not None:  # the prediction is this step: same slots, same blocks read
                assert np.array_equal(plan.slots[index], step.slot_mapping)
        result = model.run(step)
        plan = None
        if step.num_rows == step.num_decode_rows == step.num_tokens:
            plan = plan_next_decode(step, BS, MAX_LEN)
            if plan is not None:
                made += 1
                plan.input_ids[:] = [tokens[0] for tokens in result.tokens_per_row()]
        scheduler.postprocess(step, result)
        decoding = set(scheduler.batch.req_ids[: scheduler.batch.num_decode])
    assert_no_leaks(scheduler)
    return made, matched, [r.output_token_ids for r in requests]


def _expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(reference_next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


PROMPTS = [[5, 1, 2], [7, 7, 3, 1, 9], [2], [4, 4, 4, 4, 4, 4]]
LENGTHS = [13, 9, 17, 6]


def test_with_lookahead_every_decode_step_is_predicted_across_block_boundaries() -> None:
    made, matched, outputs = _run(_scheduler(64, lookahead=True), PROMPTS, LENGTHS)
    assert outputs == [_expected(p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    # One prefill step, then 16 decode steps (c's 17 tokens): each predicts its successor, and
    # each prediction but the last (no step follows) is the step scheduled next — a finished
    # row leaves a subset of the rows.
    assert (made, matched) == (16, 15)


def test_without_lookahead_a_row_at_a_block_boundary_stops_the_prediction() -> None:
    made, matched, outputs = _run(_scheduler(64, lookahead=False), PROMPTS, LENGTHS)
    assert outputs == [_expected(p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    # Half the decode steps have a row whose next token opens a block.
    assert (made, matched) == (8, 7)


def test_lookahead_takes_the_next_blocks_all_or_none_and_never_preempts() -> None:
    scheduler = _scheduler(4, lookahead=True)  # 16 slots
    scheduler.add(Request(0, [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)))
    scheduler.add(Request(1, [4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True)))
    model = PagedFakeModel(4, BS, VOCAB)
    step = scheduler.schedule()  # both prompts: 3 tokens each, one block each, then sampling
    assert step.num_decode_rows == 0
    scheduler.postprocess(step, model.run(step))
    step = scheduler.schedule()  # decode at position 3; the next token (4) opens block 2 of each
    assert step.decode_lookahead
    kv = scheduler.kv_cache_manager
    assert [len(kv.block_ids(0)), len(kv.block_ids(1))] == [2, 2] and kv.num_free_blocks == 0
    scheduler.postprocess(step, model.run(step))
    # Positions 4..7 lie in the blocks taken one step early: nothing new to take.
    for _ in range(3):
        step = scheduler.schedule()
        assert step.decode_lookahead
        scheduler.postprocess(step, model.run(step))
    step = scheduler.schedule()  # position 7: the next token opens block 3, the pool is empty
    assert not step.decode_lookahead and scheduler.num_preemptions == 0
    assert [len(kv.block_ids(0)), len(kv.block_ids(1))] == [2, 2]
    assert plan_next_decode(step, BS, MAX_LEN) is None


def test_lookahead_with_prefix_caching_caches_only_full_blocks_and_serves_a_later_hit() -> None:
    scheduler = Scheduler(
        num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=MAX_LEN, enable_prefix_caching=True, decode_lookahead=True,
    )  # fmt: skip
    kv = scheduler.kv_cache_manager
    model = PagedFakeModel(kv.num_blocks, BS, VOCAB)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # two full blocks and one token of a third
    # 9 prompt + 6 generated = 15 tokens; the last one is never computed, so 14 tokens of KV:
    # blocks 0-2 full (12 tokens), block 3 half (2), and block 4 taken one step early for the
    # token at position 15 — which never comes, so it holds nothing.
    made, matched, outputs = _run(scheduler, [prompt], [6], model)
    assert outputs == [_expected(prompt, 6)]
    assert (made, matched) == (5, 4)
    # Only the three full blocks stay cached; the half block and the never-written lookahead
    # block went back to the vacant pool with no key.
    cached = kv.cached_free_blocks()
    assert len(cached) == 3
    assert [b for b in range(kv.num_blocks) if kv.block_keys[b] is not None] == sorted(cached)
    assert kv.num_free_blocks == kv.num_blocks and kv.ref_counts == [0] * kv.num_blocks

    # The same prompt again hits the two full prompt blocks (the last prompt token is always
    # recomputed), decodes across the boundaries it owns one step early, and gets the same tokens.
    made, matched, outputs = _run(scheduler, [prompt], [6], model)
    assert outputs == [_expected(prompt, 6)]
    assert (made, matched) == (5, 4)
    assert (scheduler.prefix_cache_stats.num_requests, scheduler.prefix_cache_stats.hit_tokens) == (2, 8)
    assert sorted(kv.cached_free_blocks()) == sorted(cached)
