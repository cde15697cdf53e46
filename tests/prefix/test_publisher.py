"""KVEventPublisher over real ZMQ sockets on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from baton_engine.contract import kv_events_topic
from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.wire import REPLAY_END_SEQ
from baton_support.wait import wait_for
from tests.prefix.records import BlocksRemoved, BlocksStored
from tests.prefix.reference_decoder import decode_event_batch

TOPIC = kv_events_topic("10.0.0.7", "smollm2")
MakePublisher = Callable[..., KVEventPublisher]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: KVEventPublisher, topic: str = ""
) -> zmq.Socket[bytes]:
    """A SUB socket connected to the publisher (live once `publish_until_received` returns)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    return sub


def stored(i: int) -> BlocksStored:
    return BlocksStored((2**40 + i,), None, (i, i + 1), 2)


def publish_until_received(pub: KVEventPublisher, sub: zmq.Socket[bytes]) -> list[list[bytes]]:
    """Publish numbered batches until the subscription is live; returns what was received.

    Returns only once the last batch published here has arrived too, so that none of them is
    still on its way when the caller publishes more (a slow sender thread can be several
    batches behind the first one received).
    """
    got: list[list[bytes]] = []
    published = 0

    def publish_one() -> bool:
        nonlocal published
        pub.publish([stored(published)], ts=float(published))
        published += 1
        if sub.poll(20):
            got.append(sub.recv_multipart())
        return bool(got)

    wait_for(publish_one, interval=0, message="the subscription to become live")
    i = published
    last = (i - 1).to_bytes(8, "big")  # numbering starts at 0 and only this helper published
    while got[-1][1] != last:
        assert sub.poll(30_000), f"batch {i - 1} never arrived"
        got.append(sub.recv_multipart())
    return got


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_frame: bytes) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_frame])
    replies = []
    while True:
        assert dealer.poll(5000), "no replay reply"
        reply = dealer.recv_multipart()
        replies.append(reply)
        if reply[1] == REPLAY_END_SEQ:
            dealer.close(linger=0)
            return replies


def test_frames_topic_and_sequence_numbers_from_zero(make_publisher: MakePublisher, ctx: zmq.Context) -> None:
    pub = make_publisher(TOPIC)
    assert TOPIC == "kv@10.0.0.7@smollm2"
    sub = subscribe(ctx, pub)
    first = publish_until_received(pub, sub)[0]
    first_seq = int.from_bytes(first[1], "big")
    for i in range(3):
        pub.publish([BlocksRemoved((2**50 + i,))], ts=100.0 + i)
    received = [sub.recv_multipart() for _ in range(3)]
    # Everything published before the subscription was live is still in the replay buffer, so
    # the replay shows the numbering starts at 0 and has no holes.
    all_batches = replay(ctx, pub.replay_endpoint or "", (0).to_bytes(8, "big"))
    seqs = [int.from_bytes(r[1], "big") for r in all_batches[:-1]]
    assert seqs == list(range(len(seqs)))
    assert first_seq in seqs
    for offset, msg in enumerate(received):
        assert len(msg) == 3
        assert msg[0] == b"kv@10.0.0.7@smollm2"
        assert msg[1] == (len(seqs) - 3 + offset).to_bytes(8, "big")
        batch = decode_event_batch(msg[2])
        assert batch["ts"] == 100.0 + offset
        assert batch["data_parallel_rank"] == 0
        assert batch["events"] == [
            {"type": "BlockRemoved", "block_hashes": [2**50 + offset], "medium": "GPU", "group_idx": 0}
        ]


def test_topic_filter_selects_the_pod(make_publisher: MakePublisher, ctx: zmq.Context) -> None:
    pub = make_publisher(kv_events_topic("10.0.0.1", "m"))
    other_pod = subscribe(ctx, pub, "kv@10.0.0.2@")
    this_pod = subscribe(ctx, pub, "kv@10.0.0.1@")
    received = publish_until_received(pub, this_pod)
    assert received[0][0] == b"kv@10.0.0.1@m"
    assert other_pod.poll(100) == 0


def test_replay_from_a_midpoint_then_end_marker(make_publisher: MakePublisher, ctx: zmq.Context) -> None:
    pub = make_publisher(TOPIC, buffer_steps=100)
    for i in range(10):
        pub.publish([stored(i)], ts=float(i))
    wait_for(
        lambda: len(replay(ctx, pub.replay_endpoint or "", (9).to_bytes(8, "big"))) == 2, message="10 sent"
    )
    replies = replay(ctx, pub.replay_endpoint or "", (6).to_bytes(8, "big"))
    assert [r[1] for r in replies] == [i.to_bytes(8, "big") for i in (6, 7, 8, 9)] + [b"\xff" * 8]
    assert replies[-1] == [b"", b"\xff" * 8, b""]
    for reply, i in zip(replies[:-1], (6, 7, 8, 9), strict=True):
        assert reply[0] == b""
        assert decode_event_batch(reply[2])["events"][0]["block_hashes"] == [2**40 + i]
        assert decode_event_batch(reply[2])["ts"] == float(i)
    # Past the end: only the marker.
    assert replay(ctx, pub.replay_endpoint or "", (50).to_bytes(8, "big")) == [[b"", b"\xff" * 8, b""]]


def test_replay_buffer_keeps_the_last_buffer_steps(make_publisher: MakePublisher, ctx: zmq.Context) -> None:
    pub = make_publisher(TOPIC, buffer_steps=3)
    for i in range(8):
        pub.publish([stored(i)])
    endpoint = pub.replay_endpoint or ""
    wait_for(
        lambda: replay(ctx, endpoint, (7).to_bytes(8, "big"))[0][1] == (7).to_bytes(8, "big"),
        message="8 sent",
    )
    replies = replay(ctx, endpoint, (0).to_bytes(8, "big"))
    assert [int.from_bytes(r[1], "big", signed=True) for r in replies] == [5, 6, 7, -1]


def test_malformed_replay_request_is_ignored(make_publisher: MakePublisher, ctx: zmq.Context) -> None:
    pub = make_publisher(TOPIC)
    pub.publish([stored(0)])
    # Sent (hence buffered) before the requests below: otherwise the valid one may be answered
    # with the end marker alone.
    endpoint = pub.replay_endpoint or ""
    wait_for(lambda: len(replay(ctx, endpoint, (0).to_bytes(8, "big"))) == 2, message="batch 0 sent")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint or "")
    dealer.send_multipart([b"", b"\x00\x01"])  # 2-byte start: not a sequence number
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    first = dealer.recv_multipart()
    assert first[1] == (0).to_bytes(8, "big")  # the valid request is answered, the bad one not
    assert dealer.recv_multipart() == [b"", b"\xff" * 8, b""]
    assert dealer.poll(100) == 0
    dealer.close(linger=0)


def test_high_water_mark_is_configurable(make_publisher: MakePublisher) -> None:
    assert make_publisher(TOPIC, sndhwm=17).sndhwm == 17
    assert make_publisher(TOPIC).sndhwm == 100_000
    with pytest.raises(ValueError, match="sndhwm must be >= 0"):
        make_publisher(TOPIC, sndhwm=-1)
    with pytest.raises(ValueError, match="buffer_steps must be at least 1, got 0"):
        make_publisher(TOPIC, buffer_steps=0)


def test_full_queue_drops_and_then_publishes_all_blocks_cleared(
    make_publisher: MakePublisher, ctx: zmq.Context
) -> None:
    pub = make_publisher(TOPIC, max_queue=1)
    results = [pub.publish([stored(i)]) for i in range(200)]
    assert pub.dropped_batches == results.count(False) > 0
    endpoint = pub.replay_endpoint or ""

    def last_is_clear() -> bool:
        replies = replay(ctx, endpoint, (0).to_bytes(8, "big"))
        return len(replies) > 1 and decode_event_batch(replies[-2][2])["events"] == [
            {"type": "AllBlocksCleared"}
        ]

    wait_for(last_is_clear, message="AllBlocksCleared after the overflow")


def test_publish_never_blocks_the_caller(make_publisher: MakePublisher) -> None:
    pub = make_publisher(TOPIC, sndhwm=1)
    start = time.perf_counter()
    for i in range(2000):
        pub.publish([stored(i)])
    assert time.perf_counter() - start < 1.0


def test_shutdown_closes_sockets_and_refuses_more(make_publisher: MakePublisher) -> None:
    pub = make_publisher(TOPIC)
    endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
    pub.publish([stored(0)])
    pub.shutdown()
    pub.shutdown()  # idempotent
    assert not pub._thread.is_alive()
    with pytest.raises(RuntimeError, match="KVEventPublisher is shut down"):
        pub.publish([stored(1)])
    # Both ports are free again.
    again = KVEventPublisher(endpoint, TOPIC, replay_endpoint=replay_endpoint)
    assert again.endpoint == endpoint
    again.shutdown()
