"""Decode-ahead: run step n+1 of a greedy decode batch while the scheduler is still planning it.

After a plain greedy decode step the runner knows everything step n+1 will most likely be: the
same rows, each fed the token it just sampled, one position further, writing the next slot of
the block it already owns. It launches that step on the device right away — before the host has
even read step n's tokens: step n+1 takes them from the device — so the device always has the
next step queued while the host reads tokens, runs postprocess and the next `schedule()` (the
host time per step is otherwise added to every decode step). The plan's `input_ids` are filled
in once step n's tokens reach the host. When the real step arrives, `match_rows` checks it field
by field against the prediction; only an exact match (rows may have left the batch) takes the
precomputed tokens, anything else runs normally.

A prediction is made only when every row's next position lies inside a block it owns: inside
its last block, or, when the scheduler handed out the next blocks one step early
(`SchedulerOutput.decode_lookahead`), also at a block boundary. So the step writes nothing
outside blocks that row holds at launch time; a block freed later is rewritten by its
next owner after this step in stream order. Pure numpy: the predicate is tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from baton_engine.core.scheduler_output import SchedulerOutput


@dataclass
class AheadPlan:
    """The predicted next decode step, in the row order of the step it was derived from."""

    req_ids: npt.NDArray[np.int64]
    input_ids: npt.NDArray[np.int64]
    """The tokens the rows are fed: -1 (matching no step) until the runner fills them in."""
    positions: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]
    seq_lens: npt.NDArray[np.int64]
    block_tables: npt.NDArray[np.int64]

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)


def is_decode_only(step: SchedulerOutput) -> bool:
    """One query token per row, no prefill rows."""
    return step.num_rows > 0 and step.num_decode_rows == step.num_rows and step.num_tokens == step.num_rows


def plan_next_decode(step: SchedulerOutput, block_size: int, max_model_len: int) -> AheadPlan | None:
    """The step after decode-only `step` (its input ids unknown yet: -1); None when any row
    would cross into a block it does not own yet (a boundary without `decode_lookahead`) or
    reach `max_model_len`."""
    seq_lens = np.asarray(step.seq_lens, dtype=np.int64)
    tables = np.asarray(step.block_tables, dtype=np.int64)
    nxt = seq_lens  # the next position of every row is its current length
    col = nxt // block_size
    if not step.decode_lookahead and bool((nxt % block_size == 0).any()):
        return None
    if bool((nxt >= max_model_len).any()):
        return None
    if bool((col >= tables.shape[1]).any()):
        return None
    rows = np.arange(len(nxt))
    slots = tables[rows, col] * block_size + nxt % block_size
    return AheadPlan(
        req_ids=np.asarray(step.req_ids, dtype=np.int64),
        input_ids=np.full(len(nxt), -1, dtype=np.int64),
        positions=nxt.copy(),
        slots=slots,
        seq_lens=seq_lens + 1,
        block_tables=tables.copy(),
    )


def match_rows(plan: AheadPlan, step: SchedulerOutput, block_size: int) -> npt.NDArray[np.int64] | None:
    """For each row of `step`, its row in `plan` — when `step` is exactly the predicted step
    restricted to some of its rows (others finished or were preempted); else None."""
    if not is_decode_only(step):
        return None
    req_ids = np.asarray(step.req_ids, dtype=np.int64)
    if np.array_equal(req_ids, plan.req_ids):  # no row left: the common case, no per-row lookup
        index = np.arange(len(req_ids), dtype=np.int64)
    else:
        where = {s: j for j, s in enumerate(plan.req_ids.tolist())}
        try:
            index = np.array([where[s] for s in req_ids.tolist()], dtype=np.int64)
        except KeyError:
            return None
        if len(set(index.tolist())) != len(index):
            return None
    seq_lens = np.asarray(step.seq_lens, dtype=np.int64)
    if not (
        np.array_equal(np.asarray(step.input_ids, dtype=np.int64), plan.input_ids[index])
        and np.array_equal(np.asarray(step.positions, dtype=np.int64), plan.positions[index])
        and np.array_equal(np.asarray(step.slot_mapping, dtype=np.int64), plan.slots[index])
        and np.array_equal(seq_lens, plan.seq_lens[index])
    ):
        return None
    # Attention read the blocks of the plan's table: they must be the ones the step names.
    tables = np.asarray(step.block_tables, dtype=np.int64)
    used = -(-seq_lens // block_size)
    width = int(used.max())
    if width > tables.shape[1] or width > plan.block_tables.shape[1]:
        return None
    in_use = np.arange(width)[None, :] < used[:, None]
    if not np.array_equal(tables[:, :width][in_use], plan.block_tables[index, :width][in_use]):
        return None
    return index
