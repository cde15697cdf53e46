"""Pulls between a real producer and consumer over ZMQ on 127.0.0.1 with real torch caches."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

from baton_engine.contract import KVTransferParamsError
from baton_engine.kv_transfer.consumer import KVTransferConsumer
from baton_engine.kv_transfer.leases import LeaseEnd
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.params import verify_params
from baton_engine.kv_transfer.producer import KVTransferProducer
from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError
from baton_support.wait import wait_for
from tests.kv_transfer.helpers import KEY, make_cache, signed_params

MakeProducer = Callable[..., KVTransferProducer]
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_full_pull_copies_blocks_byte_for_byte(make_producer: MakeProducer) -> None:
    src = make_cache(1)
    stats = TransferStats()
    producer = make_producer(src, stats=stats)
    producer.add_lease("t1", [7, 3, 21, 22, 23, 0], 30.0)
    dst = make_cache(None)
    consumer = KVTransferConsumer(dst, stats=stats)
    params = signed_params(src, port=producer.port, transfer_id="t1", block_ids=[7, 3, 21, 22, 23, 0])

    result = consumer.pull(params, [30, 31, 5, 6, 2, 39])

    block_bytes = 3 * 2 * 4 * 2 * 8 * 4
    assert (result.num_blocks, result.num_bytes) == (6, 6 * block_bytes)
    for s, d in zip([7, 3, 21, 22, 23, 0], [30, 31, 5, 6, 2, 39], strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = sorted(set(range(40)) - {30, 31, 5, 6, 2, 39})
    assert torch.count_nonzero(dst[:, :, untouched]).item() == 0
    wait_for(lambda: producer.leases.block_ids("t1") is None, message="lease ended")
    assert producer.take_ended() == [("t1", LeaseEnd.DONE)]
    delta = stats.take()
    assert (delta.bytes_sent, delta.bytes_received, delta.failures) == (6 * block_bytes, 6 * block_bytes, {})
    assert len(delta.pull_seconds) == 1 and len(delta.serve_seconds) == 1


def test_partial_pull_skips_the_consumers_prefix_hit(make_producer: MakeProducer) -> None:
    src = make_cache(2)
    producer = make_producer(src, chunk_bytes=1)  # one block per chunk: 4 chunks
    ids = [10, 11, 12, 13, 14, 15]
    producer.add_lease("t2", ids, 30.0)
    dst = make_cache(None)
    dst[:, :, 0:2] = 5.0  # the consumer's own cached prefix
    chunks: list[int] = []

    KVTransferConsumer(dst).pull(
        signed_params(src, port=producer.port, transfer_id="t2", block_ids=ids),
        [20, 21, 22, 23],
        skip_blocks=2,
        on_chunk=chunks.append,
    )

    assert chunks == [0, 1, 2, 3]
    assert torch.equal(dst[:, :, 20:24], src[:, :, 12:16])
    assert bool((dst[:, :, 0:2] == 5.0).all())
    assert torch.count_nonzero(dst[:, :, 2:20]).item() == 0


def test_multi_chunk_with_short_last_chunk_and_bfloat16(make_producer: MakeProducer) -> None:
    src = make_cache(3, dtype=torch.bfloat16)
    block_bytes = 3 * 2 * 4 * 2 * 8 * 2
    producer = make_producer(src, chunk_bytes=3 * block_bytes)
    ids = [39, 1, 2, 3, 17, 18, 30]  # chunks of 3, 3, 1 blocks
    producer.add_lease("t3", ids, 30.0)
    dst = make_cache(None, dtype=torch.bfloat16)
    chunks: list[int] = []
    KVTransferConsumer(dst).pull(
        signed_params(src, port=producer.port, transfer_id="t3", block_ids=ids),
        [0, 1, 2, 9, 10, 11, 12],
        on_chunk=chunks.append,
    )
    assert chunks == [0, 1, 2]
    assert torch.equal(dst[:, :, [0, 1, 2, 9, 10, 11, 12]], src[:, :, ids])


def test_everything_cached_sends_only_done(make_producer: MakeProducer) -> None:
    src = make_cache(4)
    producer = make_producer(src)
    producer.add_lease("t4", [1, 2], 30.0)
    dst = make_cache(None)
    result = KVTransferConsumer(dst).pull(
        signed_params(src, port=producer.port, transfer_id="t4", block_ids=[1, 2]), [], skip_blocks=2
    )
    assert (result.num_blocks, result.num_bytes) == (0, 0)
    assert torch.count_nonzero(dst).item() == 0
    wait_for(lambda: producer.leases.block_ids("t4") is None, message="lease ended")
    assert producer.take_ended() == [("t4", LeaseEnd.DONE)]


def test_bad_destination_is_a_caller_error(make_producer: MakeProducer) -> None:
    src = make_cache(5)
    params = signed_params(src, port=5, transfer_id="t", block_ids=[1, 2, 3])
    consumer = KVTransferConsumer(make_cache(None))
    with pytest.raises(
        ValueError, match=r"2 destination blocks for 3 source blocks \(3 minus 0 already cached\)"
    ):
        consumer.pull(params, [0, 1])
    with pytest.raises(ValueError, match=r"dst_block_ids: block id 40 outside \[0, 40\)"):
        consumer.pull(params, [0, 1, 40])


def _expect_failure(
    consumer: KVTransferConsumer, params: object, dst: list[int], reason: FailureReason, message: str
) -> float:
    started = time.monotonic()
    with pytest.raises(KVTransferError) as caught:
        consumer.pull(params, dst)  # type: ignore[arg-type]
    assert caught.value.reason is reason
    assert message in caught.value.message
    return time.monotonic() - started


def test_unknown_transfer_id_is_an_explicit_error(make_producer: MakeProducer) -> None:
    src = make_cache(6)
    producer = make_producer(src)
    stats = TransferStats()
    consumer = KVTransferConsumer(make_cache(None), stats=stats, timeout_s=30.0)
    params = signed_params(src, port=producer.port, transfer_id="never-leased", block_ids=[1])
    took = _expect_failure(consumer, params, [0], FailureReason.UNKNOWN_TRANSFER, "'never-leased'")
    assert took < 15.0  # an answer, not the 30 s timeout
    assert stats.take().failures == {"unknown_transfer": 1}


def test_engine_id_mismatch(make_producer: MakeProducer) -> None:
    src = make_cache(7)
    producer = make_producer(src, engine_id="restarted-engine")
    producer.add_lease("t", [1], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[1], engine_id="old-engine")
    _expect_failure(
        KVTransferConsumer(make_cache(None)),
        params,
        [0],
        FailureReason.ENGINE_MISMATCH,
        "transfer issued by engine 'old-engine', this is engine 'restarted-engine'",
    )
    assert producer.leases.block_ids("t") == [1]  # not this consumer's lease to end


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"dtype": "bfloat16"}, "dtype 'float32' != 'bfloat16'"),
        ({"block_size": 8, "num_tokens": 8}, "block_size 4 != 8"),
        ({"layout": "layers,blocks,kv,block_size,kv_heads,head_dim"}, "layout 'layers,kv,blocks"),
    ],
)
def test_spec_mismatch_in_params_fails_before_connecting(override: dict[str, object], message: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    with listener:
        src = make_cache(8)
        params = signed_params(
            src, port=listener.getsockname()[1], transfer_id="t", block_ids=[1], **override
        )
        stats = TransferStats()
        _expect_failure(
            KVTransferConsumer(make_cache(None), stats=stats),
            params,
            [0],
            FailureReason.SPEC_MISMATCH,
            message,
        )
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
        assert stats.take().failures == {"spec_mismatch": 1}


def test_kv_key_mismatch_is_refused_before_any_pull_and_the_lease_released(
    make_producer: MakeProducer,
) -> None:
    """A consumer refuses params from a producer of another KV-compatibility key (a pod of the
    other generation of a rollout): nothing is pulled, and it releases the lease instead of
    leaving the producer's blocks pinned until expiry."""
    src = make_cache(12)
    producer_stats, consumer_stats = TransferStats(), TransferStats()
    producer = make_producer(src, stats=producer_stats, kv_key="old-key")
    producer.add_lease("t", [1, 2], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[1, 2], kv_key="old-key")
    dst = make_cache(None)
    _expect_failure(
        KVTransferConsumer(dst, stats=consumer_stats, kv_key="new-key"),
        params,
        [0, 1],
        FailureReason.KV_KEY_MISMATCH,
        "kv_transfer_params.kv_key: the producer's KV-compatibility key 'old-key' is not this "
        "engine's 'new-key'",
    )
    wait_for(lambda: producer.leases.block_ids("t") is None, message="lease released")
    assert producer.take_ended() == [("t", LeaseEnd.RELEASED)]
    assert torch.count_nonzero(dst).item() == 0
    assert consumer_stats.take().failures == {"kv_key_mismatch": 1}
    assert producer_stats.take().bytes_sent == 0


def test_producer_refuses_a_pull_from_a_consumer_of_another_kv_key(make_producer: MakeProducer) -> None:
    """The producer checks too: params that claim the consumer's key (signed by the deployment,
    so only a misconfigured pod could send them) get ERR kv_key_mismatch and no block."""
    src = make_cache(13)
    producer_stats = TransferStats()
    producer = make_producer(src, stats=producer_stats, kv_key="key-a")
    producer.add_lease("t", [3], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[3], kv_key="key-b")
    _expect_failure(
        KVTransferConsumer(make_cache(None), kv_key="key-b"),
        params,
        [0],
        FailureReason.KV_KEY_MISMATCH,
        "producer KV-compatibility key 'key-a' != consumer's 'key-b'",
    )
    assert producer_stats.take().failures == {"kv_key_mismatch": 1}
    # The consumer releases after any refusal the producer answered (it might still hold it).
    wait_for(lambda: producer.leases.block_ids("t") is None, message="lease released")
    assert producer.take_ended() == [("t", LeaseEnd.RELEASED)]


def test_same_kv_key_pulls(make_producer: MakeProducer) -> None:
    src = make_cache(14)
    producer = make_producer(src, kv_key="k1")
    producer.add_lease("t", [5, 6], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[5, 6], kv_key="k1")
    dst = make_cache(None)
    assert KVTransferConsumer(dst, kv_key="k1").pull(params, [8, 9]).num_blocks == 2
    assert torch.equal(dst[:, :, 8:10], src[:, :, 5:7])


def test_cache_shape_mismatch_is_detected_by_the_producer_which_releases(make_producer: MakeProducer) -> None:
    src = make_cache(9, layers=4)
    producer = make_producer(src)
    producer.add_lease("t", [1, 2], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[1, 2])
    _expect_failure(
        KVTransferConsumer(make_cache(None, layers=3)),
        params,
        [0, 1],
        FailureReason.SPEC_MISMATCH,
        "producer vs consumer: num_layers 4 != 3",
    )
    wait_for(lambda: producer.leases.block_ids("t") is None, message="lease released")
    assert producer.take_ended() == [("t", LeaseEnd.RELEASED)]


def test_blocks_outside_the_lease_are_refused(make_producer: MakeProducer) -> None:
    src = make_cache(10)
    producer = make_producer(src)
    producer.add_lease("t", [1, 2], 30.0)
    params = signed_params(src, port=producer.port, transfer_id="t", block_ids=[1, 3])
    _expect_failure(
        KVTransferConsumer(make_cache(None)),
        params,
        [0, 1],
        FailureReason.BAD_REQUEST,
        "3 is not in the lease",
    )


def test_lease_expiry_frees_and_later_pull_is_told_so(make_producer: MakeProducer) -> None:
    src = make_cache(11)
    stats = TransferStats()
    producer = make_producer(src, stats=stats)
    producer.add_lease("short", [4, 5], 0.2)
    ended: list[tuple[str, LeaseEnd]] = []
    wait_for(lambda: bool(ended.extend(producer.take_ended()) or ended), message="lease expiry")
    assert ended == [("short", LeaseEnd.EXPIRED)]
    assert stats.take().leases_expired == 1
    params = signed_params(src, port=producer.port, transfer_id="short", block_ids=[4, 5])
    _expect_failure(
        KVTransferConsumer(make_cache(None)), params, [0, 1], FailureReason.LEASE_EXPIRED, "'short'"
    )


def test_release_message_and_local_release(make_producer: MakeProducer) -> None:
    src = make_cache(12)
    producer = make_producer(src)
    producer.add_lease("remote", [1], 30.0)
    producer.add_lease("local", [2], 30.0)
    consumer = KVTransferConsumer(make_cache(None))
    assert (
        consumer.release(signed_params(src, port=producer.port, transfer_id="remote", block_ids=[1])) is True
    )
    assert producer.release("local") is True
    assert producer.release("local") is False
    wait_for(lambda: len(producer.leases) == 0, message="both leases ended")
    assert sorted(producer.take_ended()) == [("local", LeaseEnd.RELEASED), ("remote", LeaseEnd.RELEASED)]
    assert (
        consumer.release(signed_params(src, port=producer.port, transfer_id="remote", block_ids=[1])) is False
    )


def test_unreachable_producer_fails_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    params = signed_params(make_cache(13), port=port, transfer_id="t", block_ids=[1])
    took = _expect_failure(
        KVTransferConsumer(make_cache(None), timeout_s=30.0),
        params,
        [0],
        FailureReason.PRODUCER_UNREACHABLE,
        f"tcp://127.0.0.1:{port} (refused)",
    )
    assert took < 15.0  # refused at once, not the 30 s timeout


def test_silent_producer_times_out() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        params = signed_params(make_cache(14), port=port, transfer_id="t", block_ids=[1])
        took = _expect_failure(
            KVTransferConsumer(make_cache(None), timeout_s=0.3),
            params,
            [0],
            FailureReason.TIMEOUT,
            "within 0.3s",
        )
        assert 0.3 <= took < 5.0
    finally:
        silent.close(linger=0)


@pytest.fixture
def producer_process() -> Iterator[Callable[[int, int, str], tuple[subprocess.Popen[str], int]]]:
    started: list[subprocess.Popen[str]] = []

    def start(seed: int, num_blocks: int, transfer_id: str) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.kv_transfer.producer_process",
                str(seed),
                str(num_blocks),
                transfer_id,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        return proc, int(proc.stdout.readline())

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow
def test_producer_killed_mid_transfer_fails_promptly(
    producer_process: Callable[[int, int, str], tuple[subprocess.Popen[str], int]],
) -> None:
    num_blocks = 2048  # 8 layers: 8 MiB in 4 KiB chunks
    proc, port = producer_process(15, num_blocks, "doomed")
    src_spec_cache = make_cache(None, num_blocks=1, layers=8)
    params = signed_params(
        src_spec_cache,
        port=port,
        transfer_id="doomed",
        block_ids=list(range(num_blocks)),
        engine_id="producer-proc",
    )
    dst = make_cache(None, num_blocks=num_blocks, layers=8)
    stats = TransferStats()
    consumer = KVTransferConsumer(dst, stats=stats, timeout_s=30.0)
    killed_at: list[float] = []

    def kill_on_first_chunk(index: int) -> None:
        if index == 0:
            proc.kill()
            proc.wait(timeout=10)
            killed_at.append(time.monotonic())

    with pytest.raises(KVTransferError) as caught:
        consumer.pull(params, list(range(num_blocks)), on_chunk=kill_on_first_chunk)
    assert caught.value.reason is FailureReason.PRODUCER_GONE
    assert time.monotonic() - killed_at[0] < 15.0  # noticed, not the 30 s timeout
    assert stats.take().failures == {"producer_gone": 1}


def test_forged_or_unsigned_params_are_refused_before_any_connection() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    with listener:
        good = signed_params(make_cache(16), port=listener.getsockname()[1], transfer_id="t", block_ids=[1])
        raw = good.to_dict()
        cases: list[tuple[object, str]] = [
            ({**raw, "signature": ""}, "kv_transfer_params.signature: missing (unsigned params)"),
            ({**raw, "block_ids": [1, 2], "num_tokens": 8}, "kv_transfer_params.signature: does not match"),
            ({**raw, "port": "x"}, "kv_transfer_params.port: wrong type str"),
            (
                {k: v for k, v in raw.items() if k != "transfer_id"},
                "kv_transfer_params.transfer_id: required",
            ),
            ({**raw, "do_remote_decode": True}, "kv_transfer_params.do_remote_decode: unknown field"),
        ]
        for candidate, message in cases:
            with pytest.raises(KVTransferParamsError, match=message.replace("(", r"\(").replace(")", r"\)")):
                verify_params(candidate, KEY)
        with pytest.raises(KVTransferParamsError, match="signature: does not match"):
            verify_params(raw, b"another-deployment")
        with pytest.raises(KVTransferParamsError, match="BATON_KV_TRANSFER_KEY unset"):
            verify_params(raw, None)
        with pytest.raises(BlockingIOError):
            listener.accept()
