"""Shared checks for the engine-core tests."""

from __future__ import annotations

from baton_engine.core.request import RequestStatus
from baton_engine.core.scheduler import Scheduler, StepResult
from tests.core.paged_fake_model import PagedFakeModel


def assert_no_leaks(scheduler: Scheduler) -> None:
    """Everything finished: all blocks free, ref counts zero, queues and the batch empty.

    Drains finished sequences not yet reported (e.g. aborted after the last step)."""
    scheduler.take_finished()
    bm = scheduler.block_manager
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts == [0] * bm.num_blocks
    assert bm.usage() == 0.0
    assert len(scheduler.waiting) == 0
    assert scheduler.num_running == 0
    assert scheduler.num_waiting == 0
    assert scheduler.num_held_transfers == 0
    assert scheduler.batch.num_decode == 0
    assert not scheduler.has_unfinished()


def check_step_invariants(scheduler: Scheduler, out: object, previously_decoding: set[int]) -> None:
    from baton_engine.core.scheduler_output import SchedulerOutput

    assert isinstance(out, SchedulerOutput)
    assert out.num_tokens <= scheduler.max_num_batched_tokens
    assert out.num_rows <= scheduler.max_num_seqs
    assert out.num_tokens == len(out.input_ids) == len(out.positions) == len(out.slot_mapping)
    assert (out.seq_lens == out.num_computed_tokens + out.query_lens).all()
    decode_ids = out.seq_ids[: out.num_decode_rows]
    assert (out.query_lens[: out.num_decode_rows] == 1 + out.num_draft_tokens[: out.num_decode_rows]).all()
    # Every sequence that was decoding still decodes this step unless it was preempted (back to
    # waiting) or aborted in between (no longer known).
    missing = previously_decoding - set(decode_ids)
    for seq_id in missing:
        seq = scheduler.get(seq_id)
        assert seq is None or seq.status is RequestStatus.WAITING, f"{seq_id} skipped a step"
    # Slots are unique within a step (no two tokens write the same KV slot).
    assert len(set(out.slot_mapping.tolist())) == out.num_tokens


def drive(
    scheduler: Scheduler,
    model: PagedFakeModel,
    *,
    max_steps: int = 10_000,
    before_step: object = None,
) -> list[StepResult]:
    """Run steps until nothing is left; checks the per-step invariants."""
    results: list[StepResult] = []
    decoding: set[int] = set()
    for step in range(max_steps):
        if callable(before_step):
            before_step(step)
        if not scheduler.has_unfinished():
            return results
        out = scheduler.schedule()
        if out.num_rows == 0:
            results.append(StepResult(out.step_id, [], [], scheduler.take_finished()))
            continue
        check_step_invariants(scheduler, out, decoding)
        results.append(scheduler.postprocess(out, model.run(out)))
        decoding = set(scheduler.batch.seq_ids[: scheduler.batch.num_decode])
    raise AssertionError(f"scheduler did not drain within {max_steps} steps")
