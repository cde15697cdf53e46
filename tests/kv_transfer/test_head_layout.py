"""P/D across TP sizes below the engine: which heads each consumer rank pulls from which producer
rank (table-tested), and pulls of head slices over real ZMQ sockets landing byte for byte in the
consumer rank's heads; a layout that cannot split the heads is refused before any connection."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from baton_engine.contract import KVTransferParamsError
from baton_engine.kv_transfer.consumer import KVTransferConsumer, RankLayout
from baton_engine.kv_transfer.head_layout import HeadSource, head_sources
from baton_engine.kv_transfer.producer import KVTransferProducer
from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError
from tests.kv_transfer.helpers import KEY, signed_params

S = HeadSource


@pytest.mark.parametrize(
    ("kv_heads", "producer_tp", "consumer_tp", "consumer_rank", "want"),
    [
        (2, 1, 1, 0, [S(0, 0, 0, 2)]),
        (2, 1, 2, 0, [S(0, 0, 0, 1)]),
        (2, 1, 2, 1, [S(0, 1, 0, 1)]),
        (2, 2, 1, 0, [S(0, 0, 0, 1), S(1, 0, 1, 1)]),
        (2, 2, 2, 1, [S(1, 0, 0, 1)]),
        # replicated producer (ranks 0, 1 hold head 0; 2, 3 head 1): the first replica for rank 0
        (2, 4, 1, 0, [S(0, 0, 0, 1), S(2, 0, 1, 1)]),
        # replicated on both sides: consumer rank 1 (head 0) reads head 0's second replica
        (2, 4, 4, 1, [S(1, 0, 0, 1)]),
        (2, 4, 4, 3, [S(3, 0, 0, 1)]),
        (2, 1, 4, 3, [S(0, 1, 0, 1)]),
        (8, 2, 4, 1, [S(0, 2, 0, 2)]),
        (8, 4, 2, 1, [S(2, 0, 0, 2), S(3, 0, 2, 2)]),
        (8, 8, 1, 0, [S(p, 0, p, 1) for p in range(8)]),
    ],
)
def test_each_consumer_rank_pulls_its_heads_from_the_ranks_holding_them(
    kv_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int, want: list[HeadSource]
) -> None:
    assert head_sources(kv_heads, producer_tp, consumer_tp, consumer_rank) == want


def test_a_layout_that_cannot_split_the_heads_is_refused() -> None:
    with pytest.raises(KVTransferError) as info:
        head_sources(2, 3, 1, 0)
    assert info.value.reason is FailureReason.SPEC_MISMATCH
    assert info.value.message == (
        "KV head layout: --tensor-parallel-size 3 exceeds the model's 2 key/value heads "
        "(num_key_value_heads) and is not a multiple of them, so they cannot be replicated evenly"
    )


def _full_cache(heads: int, seed: int = 3) -> torch.Tensor:
    shape = (3, 2, 12, 4, heads, 8)  # layers, K/V, blocks, block size, heads, head dim
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def tp2_producer() -> Iterator[tuple[torch.Tensor, list[KVTransferProducer]]]:
    """A TP=2 producer of a 4-KV-head model: rank r holds heads 2r, 2r+1, each on its own port."""
    full = _full_cache(4)
    producers = [
        KVTransferProducer(full[:, :, :, :, 2 * r : 2 * r + 2].contiguous(), engine_id="p", port=0)
        for r in (0, 1)
    ]
    for producer in producers:
        producer.add_lease("t1", [2, 3, 4, 7], 30.0)
    try:
        yield full, producers
    finally:
        for producer in producers:
            producer.close()


def _params(producers: list[KVTransferProducer], **layout: object) -> object:
    return signed_params(
        torch.zeros(3, 2, 12, 4, 2, 8),
        port=producers[0].port,
        transfer_id="t1",
        block_ids=[2, 3, 4, 7],
        engine_id="p",
        **layout,
    )


def test_a_tp1_consumer_pulls_every_head_from_both_producer_ranks(
    tp2_producer: tuple[torch.Tensor, list[KVTransferProducer]],
) -> None:
    full, producers = tp2_producer
    params = _params(producers, tp_size=2, rank_ports=[p.port for p in producers], num_kv_heads=4)
    cache = torch.zeros(3, 2, 12, 4, 4, 8)
    consumer = KVTransferConsumer(cache, layout=RankLayout(num_kv_heads=4))
    result = consumer.pull(params, [0, 5, 6, 9])  # type: ignore[arg-type]
    assert torch.equal(cache[:, :, [0, 5, 6, 9]], full[:, :, [2, 3, 4, 7]])
    assert cache[:, :, [1, 2, 3, 4, 7, 8, 10, 11]].abs().sum() == 0  # nothing else written
    assert result.num_bytes == 4 * 3 * 2 * 4 * 4 * 8 * 4
    # DONE reached both ranks: each lease ended there.
    assert [p.take_ended() for p in producers] == [[("t1", "done")], [("t1", "done")]]


def test_consumer_ranks_pull_only_their_heads_and_leave_the_lease(
    tp2_producer: tuple[torch.Tensor, list[KVTransferProducer]],
) -> None:
    full, producers = tp2_producer
    params = _params(producers, tp_size=2, rank_ports=[p.port for p in producers], num_kv_heads=4)
    for rank in range(4):  # TP=4: one head each; rank r's head lives on producer rank r // 2
        cache = torch.zeros(3, 2, 12, 4, 1, 8)
        consumer = KVTransferConsumer(cache, layout=RankLayout(num_kv_heads=4, tp_size=4, rank=rank))
        consumer.pull(params, [8, 9, 10, 11], end_lease=False)  # type: ignore[arg-type]
        assert torch.equal(cache[:, :, 8:12], full[:, :, [2, 3, 4, 7], :, rank : rank + 1])
    assert [len(p.leases) for p in producers] == [1, 1]  # rank 0 ends it once every rank pulled
    assert consumer.finish(params) is True  # type: ignore[arg-type]
    assert [p.take_ended() for p in producers] == [[("t1", "done")], [("t1", "done")]]


def test_a_producer_of_other_kv_heads_is_refused_before_any_connection(
    tp2_producer: tuple[torch.Tensor, list[KVTransferProducer]],
) -> None:
    _, producers = tp2_producer
    params = _params(producers, tp_size=2, rank_ports=[p.port for p in producers], num_kv_heads=4)
    consumer = KVTransferConsumer(torch.zeros(3, 2, 12, 4, 1, 8), layout=RankLayout(2, tp_size=2, rank=0))
    with pytest.raises(KVTransferError) as info:
        consumer.pull(params, [0, 1, 2, 3])  # type: ignore[arg-type]
    assert str(info.value) == (
        "spec_mismatch: kv_transfer_params.num_kv_heads: the producer's model has 4 KV heads, "
        "this engine's 2; refusing to pull"
    )
    assert [p.leases.acquire("t1") is not FailureReason.UNKNOWN_TRANSFER for p in producers] == [True, True]


def test_a_head_range_outside_the_producer_rank_is_refused_by_it(
    tp2_producer: tuple[torch.Tensor, list[KVTransferProducer]],
) -> None:
    _, producers = tp2_producer
    # Params that hide the layout (an older producer): the consumer asks rank 0 for heads it lacks.
    params = _params(producers)
    consumer = KVTransferConsumer(torch.zeros(3, 2, 12, 4, 1, 8), layout=RankLayout(4, tp_size=4, rank=3))
    with pytest.raises(KVTransferError) as info:
        consumer.pull(params, [0, 1, 2, 3])  # type: ignore[arg-type]
    assert info.value.reason is FailureReason.SPEC_MISMATCH
    assert info.value.message.endswith("heads [3, 1]: outside this rank's 2 KV heads")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"tp_size": 2, "rank_ports": [5601], "num_kv_heads": 2}, "rank_ports: 1 ports for tp_size 2"),
        ({"tp_size": 1, "rank_ports": [5601]}, "rank_ports: 1 ports for tp_size 1"),
        ({"tp_size": 2, "rank_ports": [5601, 0], "num_kv_heads": 2}, "rank_ports: must be integers in"),
        ({"tp_size": 2, "rank_ports": [5601, 5602]}, "num_kv_heads: must be > 0 when tp_size > 1"),
        ({"tp_size": 0}, "tp_size: must be in [1, 64]"),
    ],
)
def test_params_with_a_bad_layout_are_refused_naming_the_field(
    layout: dict[str, object], message: str
) -> None:
    with pytest.raises(KVTransferParamsError, match=r"^kv_transfer_params\." + message.replace("[", r"\[")):
        signed_params(torch.zeros(3, 2, 12, 4, 2, 8), port=5600, transfer_id="t", block_ids=[0], **layout)


def test_params_without_a_layout_sign_as_before() -> None:
    """A one-rank producer's params that carry no layout keep the payload (and so the
    signature) of the schema before the layout existed."""
    params = signed_params(torch.zeros(3, 2, 12, 4, 2, 8), port=5600, transfer_id="t", block_ids=[0])
    assert b"tp_size" not in params.payload() and b"rank_ports" not in params.payload()
    params.verify(KEY)
