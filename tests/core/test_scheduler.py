"""Exact scheduler scenarios; every scenario ends with a leak check."""

from __future__ import annotations

import hashlib
import re
import struct

import numpy as np
import pytest

from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler, StepResult
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.prefix.events import AllBlocksCleared, BlocksRemoved, BlocksStored
from tests.core.helpers import assert_no_leaks, drive
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token
from tests.core.scripted_connector import ScriptedConnector

BS = 4
EOS = 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(parent: int | None, tokens: list[int]) -> int:
    data = b"" if parent is None else struct.pack("<Q", parent)
    data += struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def make(**overrides: object) -> Scheduler:
    settings: dict[str, object] = dict(
        num_blocks=16,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        eos_token_id=EOS,
    )
    settings.update(overrides)
    return Scheduler(**settings)  # type: ignore[arg-type]


def blocks(s: Scheduler, request: Request) -> list[int]:
    return s.kv_cache_manager.block_ids(request.req_id)


def step(s: Scheduler, *tokens: int) -> tuple[SchedulerOutput, StepResult]:
    out = s.schedule()
    result = s.postprocess(out, ModelRunnerOutput(out.step_id, [[t] for t in tokens]))
    return out, result


def params(**kwargs: object) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("max_tokens", 10)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_mixed_batch_layout_and_publication() -> None:
    s = make()
    a = Request(1, [1, 2, 3, 4, 5, 6], params(max_tokens=4))
    s.add(a)
    out, _ = step(s, 7)
    assert out.req_ids == [1] and out.num_decode_rows == 0
    assert out.query_lens.tolist() == [6] and out.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert out.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5]
    assert out.logits_indices.tolist() == [5] and out.sample_rows.tolist() == [0]
    assert blocks(s, a) == [0, 1]
    assert s.kv_cache_manager.take_events() == [
        BlocksStored((key(None, [1, 2, 3, 4]),), None, (1, 2, 3, 4), BS)
    ]

    b = Request(2, list(range(20, 30)), params(max_tokens=2))
    s.add(b)
    out, result = step(s, 8)
    # One step carries A's decode token and as much of B's prompt as the budget allows.
    assert out.req_ids == [1, 2] and out.num_decode_rows == 1
    assert out.query_lens.tolist() == [1, 7] and out.query_start_loc.tolist() == [0, 1, 8]
    assert out.num_computed_tokens.tolist() == [6, 0] and out.seq_lens.tolist() == [7, 7]
    assert out.input_ids.tolist() == [7, 20, 21, 22, 23, 24, 25, 26]
    assert out.positions.tolist() == [6, 0, 1, 2, 3, 4, 5, 6]
    assert blocks(s, b) == [2, 3, 4]
    assert out.slot_mapping.tolist() == [6, 8, 9, 10, 11, 12, 13, 14]
    assert out.block_tables[:, :3].tolist() == [[0, 1, 0], [2, 3, 4]]
    assert out.sample_rows.tolist() == [0] and out.logits_indices.tolist() == [0]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 7)
    assert out.sampling.output_positions.tolist()[0] == 1
    assert result.req_ids == [1] and result.new_token_ids == [[8]]
    assert s.kv_cache_manager.take_events() == [
        BlocksStored((key(None, [20, 21, 22, 23]),), None, (20, 21, 22, 23), BS)
    ]

    out, _ = step(s, 9, 40)
    assert out.query_lens.tolist() == [1, 3]
    assert out.positions.tolist() == [7, 7, 8, 9]
    assert out.slot_mapping.tolist() == [7, 15, 16, 17]
    assert out.sample_rows.tolist() == [0, 1] and out.logits_indices.tolist() == [0, 3]
    k_a0 = key(None, [1, 2, 3, 4])
    k_b0 = key(None, [20, 21, 22, 23])
    assert s.kv_cache_manager.take_events() == [
        BlocksStored((key(k_a0, [5, 6, 7, 8]),), k_a0, (5, 6, 7, 8), BS),
        BlocksStored((key(k_b0, [24, 25, 26, 27]),), k_b0, (24, 25, 26, 27), BS),
    ]
    # A's next position (8) starts a new block: it is appended to the persistent row.
    out = s.schedule()
    assert out.block_tables[0, :3].tolist() == [0, 1, 5]
    assert out.slot_mapping.tolist() == [20, 18]
    s.postprocess(out, ModelRunnerOutput(out.step_id, [[10], [41]]))
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [7, 8, 9, 10]
    assert b.is_finished and b.output_token_ids == [40, 41]
    assert out.block_tables.base is s.batch.block_table  # a view, not a rebuilt copy
    assert s.batch.num_rows == 0
    assert_no_leaks(s)


def test_prefix_hit_skips_cached_blocks_and_counts_stats() -> None:
    s = make(max_num_batched_tokens=16)
    prompt = list(range(1, 11))
    a = Request(1, prompt, params(max_tokens=1))
    s.add(a)
    step(s, 50)
    b = Request(2, prompt, params(max_tokens=1))
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8
    assert out.num_computed_tokens.tolist() == [8] and out.query_lens.tolist() == [2]
    assert out.positions.tolist() == [8, 9]
    assert blocks(s, b) == [0, 1, 2]  # block 2 of a was partial, so never keyed
    assert [s.kv_cache_manager.ref_counts[i] for i in range(4)] == [1, 1, 1, 0]
    s.postprocess(out, ModelRunnerOutput(out.step_id, [[50]]))
    assert s.prefix_cache_stats.queried_tokens == 20 and s.prefix_cache_stats.hit_tokens == 8
    assert s.prefix_cache_stats.hit_rate == pytest.approx(0.4)
    stats = s.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (20, 8)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.num_used_kv_blocks) == (
        0,
        0,
        0.0,
        0,
    )
    assert_no_leaks(s)


@pytest.mark.parametrize(
    ("overrides", "prompt_len", "message"),
    [
        ({"max_model_len": 8}, 9, "prompt has 9 tokens, more than max_model_len=8"),
        (
            {"enable_chunked_prefill": False},
            9,
            "prompt has 9 tokens, more than max_num_batched_tokens=8 and chunked prefill is off",
        ),
        (
            {"num_blocks": 2},
            9,
            r"prompt needs 3 KV blocks, more than the whole pool \(2 blocks of 4 tokens\)",
        ),
    ],
)
def test_requests_that_can_never_fit_are_rejected(
    overrides: dict[str, object], prompt_len: int, message: str
) -> None:
    s = make(**overrides)
    bad = Request(1, list(range(1, prompt_len + 1)), params())
    good = Request(2, [1, 2, 3], params(max_tokens=1))
    s.add(bad)
    s.add(good)
    assert bad.status is RequestStatus.FINISHED and bad.finish_reason is FinishReason.REJECTED
    assert bad.finish_message is not None
    assert re.search(message, bad.finish_message)
    _, result = step(s, 9)
    assert result.finished == [bad, good]
    assert_no_leaks(s)


def test_stop_conditions() -> None:
    s = make(max_model_len=9, max_num_seqs=5, max_num_batched_tokens=16)
    eos = Request(1, [1, 2], SamplingParams(max_tokens=5))
    ignore = Request(2, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    stop_id = Request(3, [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[33], ignore_eos=True))
    length = Request(4, [1, 2], SamplingParams(max_tokens=1))
    model_len = Request(5, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=50))
    for seq in (eos, ignore, stop_id, length, model_len):
        s.add(seq)
    step(s, 5, EOS, 6, 7, 8)
    assert length.finish_reason is FinishReason.LENGTH and length.output_token_ids == [7]
    assert model_len.finish_reason is FinishReason.LENGTH and model_len.num_tokens == 9
    step(s, EOS, 33, 33)
    assert eos.finish_reason is FinishReason.STOP and eos.stop_token_id == EOS
    assert eos.output_token_ids == [5, EOS]
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.output_token_ids == [EOS, 33]
    assert stop_id.finish_reason is FinishReason.STOP and stop_id.stop_token_id == 33
    assert_no_leaks(s)


def test_abort_waiting_running_and_in_flight() -> None:
    s = make()
    running = Request(1, [1, 2, 3, 4, 5], params())
    in_flight = Request(2, [6, 7], params())
    waiting = Request(3, list(range(1, 30)), params())
    s.add(running)
    s.add(in_flight)
    step(s, 9, 9)
    s.add(waiting)
    assert s.abort(1, "client went away") is running
    assert running.finish_reason is FinishReason.ABORT and running.finish_message == "client went away"
    out = s.schedule()
    assert out.req_ids == [2, 3] and out.finished_req_ids == [1]
    assert s.abort(2) is in_flight  # applied after this step's postprocess
    assert s.abort(3) is waiting  # the chunk in flight is simply discarded
    result = s.postprocess(out, ModelRunnerOutput(out.step_id, [[11]]))
    assert [seq.req_id for seq in result.finished] == [1, 2, 3]
    assert in_flight.output_token_ids == [9, 11]
    assert s.abort(2) is None
    assert_no_leaks(s)


def test_preemption_of_the_last_admitted_keeps_the_output() -> None:
    vocab = 50
    prompts = {1: [3, 4, 5, 6, 7], 2: [8, 9, 10, 11, 12, 13]}

    def run(num_blocks: int) -> tuple[dict[int, list[int]], Scheduler]:
        s = make(num_blocks=num_blocks, max_num_batched_tokens=16)
        seqs = [Request(i, p, params(max_tokens=12)) for i, p in prompts.items()]
        for seq in seqs:
            s.add(seq)
        drive(s, PagedFakeModel(num_blocks, BS, vocab))
        assert_no_leaks(s)
        return {seq.req_id: seq.output_token_ids for seq in seqs}, s

    relaxed, s_relaxed = run(16)
    pressed, s_pressed = run(6)
    assert s_relaxed.num_preemptions == 0
    assert s_pressed.num_preemptions >= 1
    assert pressed == relaxed
    for req_id, prompt in prompts.items():
        tokens = list(prompt)
        for produced in relaxed[req_id]:
            assert produced == reference_next_token(tokens, vocab)
            tokens.append(produced)


def test_preemption_picks_the_most_recently_admitted() -> None:
    s = make(num_blocks=4, max_num_batched_tokens=16)
    first = Request(1, [1, 2, 3, 4], params(max_tokens=8))
    second = Request(2, [5, 6, 7, 8], params(max_tokens=8))
    s.add(first)
    s.add(second)
    step(s, 1, 1)  # prefill: one block each
    step(s, 1, 1)  # position 4: a second block each, the pool is now empty
    assert blocks(s, first) == [0, 2] and blocks(s, second) == [1, 3]
    assert s.kv_cache_manager.num_free_blocks == 0
    step(s, 1, 1)
    step(s, 1, 1)
    step(s, 1, 1)  # position 7: still in the second block
    out = s.schedule()  # position 8 needs a third block each: nothing free
    assert second.status is RequestStatus.WAITING and second.num_preemptions == 1
    assert out.req_ids == [1] and s.num_preemptions == 1
    assert list(s.waiting) == [second] and blocks(s, second) == []
    s.postprocess(out, ModelRunnerOutput(out.step_id, [[1]]))
    for seq in (first, second):
        s.abort(seq.req_id)
    assert_no_leaks(s)


def test_producer_keeps_blocks_until_its_lease_ends() -> None:
    connector = ScriptedConnector(BS, producer_ids=[1, 2])
    s = make(kv_connector=connector, max_num_batched_tokens=16)
    a = Request(1, list(range(1, 10)), params(max_tokens=1))
    b = Request(2, list(range(20, 25)), params(max_tokens=1))
    local = Request(3, [40, 41], params(max_tokens=1))
    for request in (a, b, local):
        s.add(request)
    _, result = step(s, 7, 8, 9)
    assert result.finished == [a, b, local]
    assert connector.leased == {1: [0, 1, 2], 2: [3, 4]}
    assert a.kv_transfer_params_out == {"transfer_id": "t-1", "block_ids": [0, 1, 2]}
    assert local.kv_transfer_params_out is None
    assert (blocks(s, a), blocks(s, b), blocks(s, local)) == ([0, 1, 2], [3, 4], [])
    assert s.kv_cache_manager.num_used_blocks == 5 and s.num_held_transfers == 2
    assert not s.has_unfinished()
    connector.end_lease(2)
    assert s.update_from_kv_connector() is True
    assert s.kv_cache_manager.num_used_blocks == 3 and blocks(s, b) == []
    assert s.update_from_kv_connector() is False  # nothing new
    connector.end_lease(1)
    assert s.schedule().num_rows == 0  # a step applies the connector's updates first
    assert connector.finished == [
        (1, FinishReason.LENGTH),
        (2, FinishReason.LENGTH),
        (3, FinishReason.LENGTH),
    ]
    assert_no_leaks(s)


def test_remote_kv_wait_does_not_block_and_resumes_as_decode() -> None:
    connector = ScriptedConnector(BS)
    s = make(kv_connector=connector)
    remote = Request(1, list(range(1, 10)), params(max_tokens=3))
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KV
    local = Request(2, [30, 31, 32], params(max_tokens=1))
    s.add(remote)
    s.add(local)
    out, _ = step(s, 5)
    assert out.req_ids == [2]  # not blocked by the request waiting for KV
    assert connector.reserved == {1: [0, 1, 2]} and remote.num_computed_tokens == 0
    assert s.num_waiting == 1
    s.kv_cache_manager.take_events()

    connector.arrive(1, num_tokens=9, first_token_id=40)
    s.update_from_kv_connector()
    k0 = key(None, [1, 2, 3, 4])
    assert s.kv_cache_manager.take_events() == [
        BlocksStored((k0, key(k0, [5, 6, 7, 8])), None, (1, 2, 3, 4, 5, 6, 7, 8), BS)
    ]
    out, _ = step(s, 41)
    assert out.req_ids == [1] and out.query_lens.tolist() == [1]
    assert out.positions.tolist() == [9] and out.input_ids.tolist() == [40]
    assert out.slot_mapping.tolist() == [2 * BS + 1]
    step(s, 42)
    assert remote.output_token_ids == [40, 41, 42] and remote.finish_reason is FinishReason.LENGTH
    assert_no_leaks(s)


def test_remote_kv_failure_recomputes() -> None:
    connector = ScriptedConnector(BS)
    s = make(kv_connector=connector)
    remote = Request(1, [1, 2, 3, 4, 5], params(max_tokens=1))
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KV
    s.add(remote)
    assert s.schedule().num_rows == 0
    assert connector.reserved == {1: [0, 1]}
    connector.fail(1, recompute=True)
    out, _ = step(s, 9)
    assert out.query_lens.tolist() == [5] and remote.output_token_ids == [9]
    assert_no_leaks(s)


def test_speculative_drafts_stats_and_rollback() -> None:
    vocab = 50
    s = make(num_speculative_tokens=3, num_blocks=16, max_num_batched_tokens=16)
    model = PagedFakeModel(16, BS, vocab)
    seq = Request(1, [1, 2, 3, 4, 5, 6], params(max_tokens=20))
    s.add(seq)
    out = s.schedule()
    s.postprocess(out, model.run(out))
    truth = list(seq.token_ids)
    for _ in range(4):
        truth.append(reference_next_token(truth, vocab))
    # Two right drafts, then a wrong one: 2 accepted + the corrected token.
    out = s.schedule({1: [truth[7], truth[8], (truth[9] + 1) % vocab]})
    assert out.query_lens.tolist() == [4] and out.num_draft_tokens.tolist() == [3]
    assert out.input_ids.tolist() == [truth[6], truth[7], truth[8], (truth[9] + 1) % vocab]
    assert out.logits_indices.tolist() == [0, 1, 2, 3]
    assert blocks(s, seq) == [0, 1, 2]  # positions 6..9 need a third block
    verified = model.run(out)
    verified.logprobs = [[[(t, -0.5)] for t in verified.sampled_token_ids[0]]]
    result = s.postprocess(out, verified)
    assert result.new_token_ids == [[truth[7], truth[8], truth[9]]]
    assert result.logprobs == [[[(truth[7], -0.5)], [(truth[8], -0.5)], [(truth[9], -0.5)]]]
    assert seq.token_ids == truth[:10]
    assert s.num_computed_tokens(seq) == 9
    assert s.spec_stats.num_draft_tokens == 3 and s.spec_stats.num_accepted_tokens == 2
    assert s.spec_stats.accepted_per_position == [1, 1, 0]
    # A wrong first draft: only the corrected token; the extra slots are rolled back.
    out = s.schedule({1: [(reference_next_token(truth, vocab) + 1) % vocab] * 3})
    assert blocks(s, seq) == [0, 1, 2, 3]
    s.postprocess(out, model.run(out))
    assert blocks(s, seq) == [0, 1, 2]
    assert s.spec_stats.accepted_per_position == [1, 1, 0]
    assert s.spec_stats.acceptance_rate == pytest.approx(2 / 6)
    assert s.spec_stats.tokens_per_forward == pytest.approx(2.0)
    s.abort(1)
    assert_no_leaks(s)


def test_delay_factor_holds_new_prompts_briefly() -> None:
    clock = FakeClock()
    s = make(clock=clock, scheduler_delay_factor=1.0)
    a = Request(1, [1, 2, 3], params(max_tokens=5), arrival_time=clock.now)
    s.add(a)
    step(s, 4)  # nothing running: admitted at once
    clock.now += 0.5
    step(s, 5)  # this step's latency since the prompt step: 0.5 s
    b = Request(2, [1, 2, 9], params(max_tokens=1), arrival_time=clock.now)
    s.add(b)
    clock.now += 0.1
    out, _ = step(s, 6)
    assert out.req_ids == [1]  # b waited 0.1 s < 1.0 x 0.5 s
    clock.now += 0.5
    out, _ = step(s, 7, 8)
    assert out.req_ids == [1, 2]
    s.abort(1)
    assert_no_leaks(s)


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        make(max_num_seqs=8, max_num_batched_tokens=4)
    s = make()
    s.add(Request(1, [1], params()))
    with pytest.raises(ValueError, match="request id 1 is already scheduled"):
        s.add(Request(1, [2], params()))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="before postprocess"):
        s.schedule()
    with pytest.raises(ValueError, match="runner output is for step 99"):
        s.postprocess(out, ModelRunnerOutput(99, [[1]]))
    s.postprocess(out, ModelRunnerOutput(out.step_id, [[1]], sampled_token_array=np.array([1])))
    s.abort(1)
    assert_no_leaks(s)


def test_remote_first_token_eos_and_failure_without_recompute() -> None:
    connector = ScriptedConnector(BS)
    s = make(kv_connector=connector)
    done = Request(1, [1, 2, 3, 4, 5], SamplingParams(max_tokens=5))
    failed = Request(2, [6, 7, 8], SamplingParams(max_tokens=5))
    for request in (done, failed):
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        s.add(request)
    assert s.schedule().num_rows == 0
    assert list(connector.reserved) == [1, 2]
    assert s.kv_cache_manager.num_used_blocks == 3
    connector.arrive(1, num_tokens=5, first_token_id=EOS)
    connector.fail(2, "KV transfer from the prefill engine failed: producer_unreachable", recompute=False)
    s.update_from_kv_connector()
    assert done.finish_reason is FinishReason.STOP and done.output_token_ids == [EOS]
    assert failed.finish_reason is FinishReason.ABORT
    assert failed.finish_message == "KV transfer from the prefill engine failed: producer_unreachable"
    connector.arrive(2, num_tokens=3)
    with pytest.raises(KeyError, match="request 2 is not waiting for remote KV"):
        s.update_from_kv_connector()
    assert s.take_finished() == [done, failed]
    assert_no_leaks(s)


def test_speculative_run_is_cut_after_a_stop_token() -> None:
    s = make(num_speculative_tokens=2)
    seq = Request(1, [1, 2, 3], SamplingParams(max_tokens=10))
    s.add(seq)
    step(s, 4)
    out = s.schedule({1: [5, EOS]})
    assert out.input_ids.tolist() == [4, 5, EOS]
    result = s.postprocess(
        out,
        ModelRunnerOutput(out.step_id, [[5, EOS, 7]], logprobs=[[[(5, -1.0)], [(EOS, -2.0)], [(7, -3.0)]]]),
    )
    assert result.new_token_ids == [[5, EOS]]
    assert result.logprobs == [[[(5, -1.0)], [(EOS, -2.0)]]]
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [4, 5, EOS]
    assert result.finished == [seq]
    assert_no_leaks(s)


def test_preempted_sequence_that_outgrew_the_pool_ends_with_length() -> None:
    s = make(num_blocks=3, max_num_batched_tokens=16)
    seq = Request(1, [1, 2, 3, 4, 5, 6, 7, 8], params(max_tokens=20))
    s.add(seq)
    for token in (9, 10, 11, 12, 13):
        step(s, token)  # 13 tokens, 12 computed: 3 blocks, the whole pool
    out = s.schedule()  # position 12 needs a 4th block: it preempts itself
    assert out.num_rows == 0 and seq.num_preemptions == 1
    assert s.schedule().num_rows == 0
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.finish_message == (
        "cannot resume after preemption: prompt + output needs 4 KV blocks, more than the whole pool "
        "(3 blocks of 4 tokens)"
    )
    assert s.take_finished() == [seq]
    assert_no_leaks(s)


def test_eviction_and_reset_events_through_the_scheduler() -> None:
    s = make(num_blocks=4, max_num_batched_tokens=16)
    a = Request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], params(max_tokens=1))
    s.add(a)
    step(s, 10)
    k0 = key(None, [1, 2, 3, 4])
    k1 = key(k0, [5, 6, 7, 8])
    assert s.kv_cache_manager.take_events() == [BlocksStored((k0, k1), None, tuple(range(1, 9)), BS)]
    assert s.kv_cache_manager.usage() == 0.0  # finished: its blocks are free (but cached)
    assert s.kv_cache_manager.cached_free_blocks() == [1, 0]
    b = Request(2, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], params(max_tokens=1))
    s.add(b)
    out = s.schedule()
    assert blocks(s, b) == [2, 3, 1]  # vacant blocks first, then the LRU cached block (a's tail)
    assert s.kv_cache_manager.usage() == 0.75
    s.postprocess(out, ModelRunnerOutput(out.step_id, [[30]]))
    kb0 = key(None, [20, 21, 22, 23])
    assert s.kv_cache_manager.take_events() == [
        BlocksRemoved((k1,)),
        BlocksStored((kb0, key(kb0, [24, 25, 26, 27])), None, tuple(range(20, 28)), BS),
    ]
    s.reset_prefix_cache()
    assert s.kv_cache_manager.take_events() == [AllBlocksCleared()]
    assert s.kv_cache_manager.cached_free_blocks() == []
    assert_no_leaks(s)


def test_discarded_step_is_recomputed() -> None:
    s = make()
    seq = Request(1, [1, 2, 3, 4, 5], params(max_tokens=2))
    s.add(seq)
    out = s.schedule()
    s.discard_step(out)  # e.g. the forward raised
    again = s.schedule()
    assert again.step_id == out.step_id + 1
    assert again.input_ids.tolist() == out.input_ids.tolist()
    assert again.slot_mapping.tolist() == out.slot_mapping.tolist()
    with pytest.raises(RuntimeError, match="is not the step in flight"):
        s.discard_step(out)
    s.postprocess(again, ModelRunnerOutput(again.step_id, [[6]]))
    step(s, 7)
    assert seq.output_token_ids == [6, 7]
    assert_no_leaks(s)


def test_from_engine_config() -> None:
    from baton_engine.config import EngineConfig

    config = EngineConfig(
        block_size=8,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        max_model_len=40,
        enable_prefix_caching=False,
        kv_events=True,
    )
    s = Scheduler.from_config(config, num_blocks=10, eos_token_id=2)
    assert (s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (8, 3, 24, 40)
    assert not s.kv_cache_manager.enable_prefix_caching and s.kv_cache_manager.record_events
    assert s.eos_token_id == 2 and s.kv_connector is None
    assert s.batch.block_table.shape == (3, 6)
