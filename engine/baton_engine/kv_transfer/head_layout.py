"""Which KV heads a consumer rank pulls from which producer rank (P/D across TP sizes).

A pod of TP size N splits the model's K KV heads as `model.parallel.kv_head_shard` does:
rank r holds K/N consecutive heads when N <= K, one head replicated on N/K ranks when N > K.
A consumer rank needs the heads of its own shard; each comes from a producer rank holding it
(of a replicated head, the replica ``consumer_rank % replicas``, so consumer ranks spread over
the replicas). Consecutive heads of one producer rank form one `HeadSource`: one pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError
from baton_engine.model.parallel import TensorParallelShapeError, kv_head_shard


@dataclass(frozen=True)
class HeadSource:
    """Heads ``[dst_head, dst_head + count)`` of this rank's cache are heads
    ``[src_head, src_head + count)`` of producer rank `producer_rank`'s cache."""

    producer_rank: int
    src_head: int
    dst_head: int
    count: int


def head_sources(
    num_kv_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> list[HeadSource]:
    """The pulls of consumer rank `consumer_rank`; raises KVTransferError (SPEC_MISMATCH) for a
    producer layout that cannot split `num_kv_heads`."""
    try:
        mine = kv_head_shard(num_kv_heads, consumer_tp, consumer_rank)
        theirs = [kv_head_shard(num_kv_heads, producer_tp, p) for p in range(producer_tp)]
    except TensorParallelShapeError as exc:
        raise KVTransferError(FailureReason.SPEC_MISMATCH, f"KV head layout: {exc}") from None
    sources: list[HeadSource] = []
    for offset in range(mine.length):
        head = mine.start + offset
        holders = [p for p, shard in enumerate(theirs) if shard.start <= head < shard.start + shard.length]
        rank = holders[consumer_rank % len(holders)]
        src = head - theirs[rank].start
        last = sources[-1] if sources else None
        if last is not None and last.producer_rank == rank and last.src_head + last.count == src:
            sources[-1] = HeadSource(rank, last.src_head, last.dst_head, last.count + 1)
        else:
            sources.append(HeadSource(rank, src, offset, 1))
    return sources
