"""Shared checks for the engine-core tests."""

from __future__ import annotations

from baton_engine.core.request import RequestStatus
from baton_engine.core.scheduler import Scheduler, StepResult
from tests.core.paged_fake_model import PagedFakeModel


def assert_no_leaks(scheduler: Scheduler) -> None:
    """Everything finished: all blocks free, ref counts zero, queues and the batch empty.

    Drains finished requests not yet reported (e.g. aborted after the last step)."""
    scheduler.take_finished()
    kv = scheduler.kv_cache_manager
    assert kv.num_used_blocks == 0
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.ref_counts == [0] * kv.num_blocks
    assert kv.usage() == 0.0
    assert kv._requests == {}, "the KV-cache manager still tracks finished requests"
    assert len(scheduler.waiting) == 0
    assert scheduler.num_running == 0
    assert scheduler.num_waiting == 0
    assert scheduler.num_held_transfers == 0
    assert scheduler.batch.num_decode == 0 and scheduler.batch._rows == {}
    assert not scheduler.has_unfinished()


def check_step_invariants(scheduler: Scheduler, out: object, previously_decoding: set[int]) -> None:
    from baton_engine.core.scheduler_output import SchedulerOutput

    assert isinstance(out, SchedulerOutput)
    assert out.num_tokens <= scheduler.max_num_batched_tokens
    assert out.num_rows <= scheduler.max_num_seqs
    assert out.num_tokens == len(out.input_ids) == len(out.positions) == len(out.slot_mapping)
    assert (out.seq_lens == out.num_computed_tokens + out.query_lens).all()
    decode_ids = out.req_ids[: out.num_decode_rows]
    assert (out.query_lens[: out.num_decode_rows] == 1 + out.num_draft_tokens[: out.num_decode_rows]).all()
    # Every request that was decoding still decodes this step unless it was preempted (back to
    # waiting) or aborted in between (no longer known).
    missing = previously_decoding - set(decode_ids)
    for req_id in missing:
        request = scheduler.get(req_id)
        assert request is None or request.status is RequestStatus.WAITING, f"{req_id} skipped a step"
    # The batch's block table is exactly what the KV-cache manager handed out.
    kv = scheduler.kv_cache_manager
    batch = scheduler.batch
    for row, req_id in enumerate(batch.req_ids):
        n = int(batch.num_blocks[row])
        assert batch.block_table[row, :n].tolist() == kv.block_ids(req_id), f"row {row} ({req_id})"
    # Slots are unique within a step (no two tokens write the same KV slot).
    assert len(set(out.slot_mapping.tolist())) == out.num_tokens


def drive(
    scheduler: Scheduler,
    model: PagedFakeModel,
    *,
    max_steps: int = 10_000,
    before_step: object = None,
    drafts: object = None,
) -> list[StepResult]:
    """Run steps until nothing is left; checks the per-step invariants."""
    results: list[StepResult] = []
    decoding: set[int] = set()
    for step in range(max_steps):
        if callable(before_step):
            before_step(step)
        if not scheduler.has_unfinished():
            return results
        out = scheduler.schedule(drafts(scheduler) if callable(drafts) else None)
        if out.num_rows == 0:  # nothing ran (its decode rows may have been preempted)
            results.append(StepResult(out.step_id, [], finished=scheduler.take_finished()))
        else:
            check_step_invariants(scheduler, out, decoding)
            results.append(scheduler.postprocess(out, model.run(out)))
        decoding = set(scheduler.batch.req_ids[: scheduler.batch.num_decode])
    raise AssertionError(f"scheduler did not drain within {max_steps} steps")
