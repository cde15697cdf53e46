from __future__ import annotations

from baton_engine.core.batch import BatchState
from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams


def row_of(batch: BatchState) -> list[int]:
    return [seq.seq_id for seq in batch.seqs]


def make_seq(seq_id: int, blocks: list[int]) -> Request:
    seq = Request(seq_id, [seq_id] * 3, SamplingParams(max_tokens=5, seed=seq_id))
    seq.block_table = list(blocks)
    return seq


def test_regions_stay_dense_and_prefill_order_is_kept() -> None:
    batch = BatchState(max_rows=8, max_blocks_per_seq=4)
    seqs = [make_seq(i, [10 * i, 10 * i + 1]) for i in range(6)]
    for seq in seqs:
        batch.add_row(seq, eos_token_id=0, max_model_len=100)
    for seq in seqs[:3]:
        batch.promote_to_decode(seq)
    assert row_of(batch) == [0, 1, 2, 3, 4, 5] and batch.num_decode == 3
    batch.num_computed[0] = 7

    batch.release_row(seqs[0])  # a decode row: refilled by the last decode row
    assert seqs[0].num_computed_tokens == 7 and seqs[0]._row == -1
    assert row_of(batch) == [2, 1, 3, 4, 5] and batch.num_decode == 2
    assert batch.block_table[:5, :2].tolist() == [[20, 21], [10, 11], [30, 31], [40, 41], [50, 51]]
    assert batch.seed[:5].tolist() == [2, 1, 3, 4, 5]

    batch.release_row(seqs[4])  # a prefill row: the later prefill rows move up, in order
    assert row_of(batch) == [2, 1, 3, 5] and [s._row for s in (seqs[3], seqs[5])] == [2, 3]

    batch.promote_to_decode(seqs[3])
    batch.append_blocks(seqs[3]._row, [33])
    assert batch.block_table[2].tolist() == [30, 31, 33, 0] and batch.num_blocks[2] == 3
    batch.truncate_blocks(2, 2)
    assert batch.block_table[2].tolist() == [30, 31, 0, 0]
    for seq in (seqs[1], seqs[2], seqs[3], seqs[5]):
        batch.release_row(seq)
    assert batch.num_rows == 0 and batch.num_decode == 0
