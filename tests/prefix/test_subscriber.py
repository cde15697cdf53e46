"""KVEventSubscriber against real publishers on loopback: order, gaps, replay, restarts, clears."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.subscriber import KVEventSubscriber
from baton_engine.prefix.wire import REPLAY_END_SEQ, encode_batch, encode_sequence
from baton_support.wait import wait_for
from tests.prefix.records import AllBlocksCleared, BlocksRemoved, BlocksStored

MakePublisher = Callable[..., KVEventPublisher]
BASE = 2**40


def chain(first: int, n: int) -> BlocksStored:
    """n consecutive blocks with hashes BASE+first.. (block size 1)."""
    hashes = tuple(BASE + first + i for i in range(n))
    parent = None if first == 0 else BASE + first - 1
    return BlocksStored(hashes, parent, tuple(range(first, first + n)), 1)


def hashes(first: int, n: int) -> list[int]:
    return [BASE + first + i for i in range(n)]


@pytest.fixture
def subscriber() -> Iterator[KVEventSubscriber]:
    sub = KVEventSubscriber(replay_timeout_s=10.0)
    yield sub
    sub.close()


class ScriptedPublisher:
    """A raw XPUB + ROUTER pair that sends chosen sequence numbers and replays chosen batches.

    XPUB rather than PUB: it reports the subscription, so a test can send batch 0 exactly once,
    after the subscription is live (a repeated 0 would read as a publisher restart).
    """

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []

    def send(self, seq: int, events: list[object], *, buffer: bool = True) -> None:
        payload = encode_batch(events, ts=float(seq))
        if buffer:
            self.buffer[seq] = payload
        self.pub.send_multipart([b"kv@scripted@m", encode_sequence(seq), payload])

    def wait_for_subscription(self, timeout_ms: int = 30_000) -> None:
        assert self.pub.poll(timeout_ms), "no subscription arrived"
        assert self.pub.recv()[:1] == b"\x01"

    def serve_one_replay(self, timeout_ms: int = 5000) -> None:
        assert self.router.poll(timeout_ms), "no replay request arrived"
        client, _, start = self.router.recv_multipart()
        self.replay_requests.append(int.from_bytes(start, "big"))
        for seq in sorted(self.buffer):
            if seq >= int.from_bytes(start, "big"):
                self.router.send_multipart([client, b"", encode_sequence(seq), self.buffer[seq]])
        self.router.send_multipart([client, b"", REPLAY_END_SEQ, b""])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def scripted() -> Iterator[ScriptedPublisher]:
    pub = ScriptedPublisher()
    yield pub
    pub.close()


def make_live(pub: KVEventPublisher, sub: KVEventSubscriber, pod: str) -> None:
    """Publish harmless batches until the subscriber has applied one (the subscription is live)."""
    probe = 0

    def applied() -> bool:
        nonlocal probe
        probe += 1
        pub.publish([BlocksRemoved((2**60 + probe,))])
        return sub.stats(pod).batches_applied > 0

    wait_for(applied, message="subscription live")


def test_events_build_the_index_in_order(
    make_publisher: MakePublisher, subscriber: KVEventSubscriber
) -> None:
    pub = make_publisher("kv@10.0.0.1@m")
    subscriber.add_pod("p1", pub.endpoint, pub.replay_endpoint)
    make_live(pub, subscriber, "p1")
    pub.publish([chain(0, 4)])
    pub.publish([BlocksRemoved((BASE + 3,))])
    wait_for(lambda: subscriber.longest_prefix_match(hashes(0, 5)) == {"p1": 3}, message="index")
    stats = subscriber.stats("p1")
    assert stats.last_topic == "kv@10.0.0.1@m"
    assert stats.gaps_lost == 0 and stats.restarts == 0


def test_late_subscriber_replays_history_from_zero(
    make_publisher: MakePublisher, subscriber: KVEventSubscriber
) -> None:
    pub = make_publisher()
    pub.publish([chain(0, 2)])
    pub.publish([chain(2, 2)])
    wait_for(lambda: pub._queue.empty(), message="sent")
    subscriber.add_pod("p1", pub.endpoint, pub.replay_endpoint)
    make_live(pub, subscriber, "p1")
    # The replay applies batch 0 and batch 1 one after the other: "something applied" can be
    # seen between the two.
    wait_for(lambda: subscriber.longest_prefix_match(hashes(0, 4)) == {"p1": 4}, message="history")
    stats = subscriber.stats("p1")
    assert stats.batches_replayed >= 2 and stats.gaps_lost == 0


def test_gap_is_filled_from_the_replay_socket(
    scripted: ScriptedPublisher, subscriber: KVEventSubscriber
) -> None:
    subscriber.add_pod("p", scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_for_subscription()
    scripted.send(0, [chain(0, 1)])
    wait_for(lambda: subscriber.stats("p").next_seq == 1, message="seq 0 applied")
    scripted.send(1, [chain(1, 1)], buffer=True)
    wait_for(lambda: subscriber.stats("p").next_seq == 2, message="seq 1")
    scripted.buffer[2] = encode_batch([chain(2, 1)], ts=2.0)  # published but lost on the way
    scripted.send(3, [chain(3, 1)])
    scripted.serve_one_replay()
    # The replayed batches are applied before the replay's end marker arrives, and only then is
    # the gap counted as filled: wait for the count, not for the sequence number alone.
    wait_for(lambda: subscriber.stats("p").gaps_filled == 1, message="gap filled")
    assert subscriber.stats("p").next_seq == 4
    assert scripted.replay_requests[-1] == 2
    assert subscriber.longest_prefix_match(hashes(0, 4)) == {"p": 4}
    assert subscriber.stats("p").gaps_lost == 0


def test_unrecoverable_gap_drops_the_pod_index(
    scripted: ScriptedPublisher, subscriber: KVEventSubscriber
) -> None:
    subscriber.add_pod("p", scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_for_subscription()
    scripted.send(0, [chain(0, 2)])
    wait_for(lambda: subscriber.stats("p").next_seq == 1, message="seq 0 applied")
    assert subscriber.longest_prefix_match(hashes(0, 2)) == {"p": 2}
    scripted.buffer.clear()  # batches 1..4 fell out of the replay buffer
    scripted.send(5, [chain(10, 1)])
    scripted.serve_one_replay()
    wait_for(lambda: subscriber.stats("p").next_seq == 6, message="seq 5")
    assert scripted.replay_requests[-1] == 1
    assert subscriber.longest_prefix_match(hashes(0, 2)) == {}  # conservative: old entries gone
    assert subscriber.longest_prefix_match(hashes(10, 1)) == {"p": 1}
    stats = subscriber.stats("p")
    assert (stats.gaps_lost, stats.gaps_filled) == (1, 0)


def test_restart_is_detected_and_the_old_index_dropped(
    make_publisher: MakePublisher, subscriber: KVEventSubscriber
) -> None:
    first = make_publisher()
    endpoint, replay_endpoint = first.endpoint, first.replay_endpoint
    subscriber.add_pod("p", endpoint, replay_endpoint)
    make_live(first, subscriber, "p")
    first.publish([chain(0, 3)])
    # Run the old stream's numbers well past what the new stream reaches while we reconnect (a
    # probe every few ms; a loaded machine can take a second or more to reconnect).
    for i in range(3000):
        first.publish([BlocksRemoved((2**61 + i,))])
    wait_for(lambda: (subscriber.stats("p").next_seq or 0) > 3000, message="old stream")
    assert subscriber.longest_prefix_match(hashes(0, 3)) == {"p": 3}
    first.shutdown()

    # The pod's engine restarts on the same address: numbering starts at 0 again. Batches sent
    # before the SUB socket has reconnected are lost in flight; the replay recovers them.
    second = make_publisher(endpoint=endpoint, replay_endpoint=replay_endpoint)
    second.publish([chain(100, 1)])
    probe = 0

    def new_stream_indexed() -> bool:
        nonlocal probe
        probe += 1
        second.publish([BlocksRemoved((2**62 + probe,))])
        return subscriber.longest_prefix_match(hashes(100, 1)) == {"p": 1}

    wait_for(new_stream_indexed, message="new stream")
    assert subscriber.longest_prefix_match(hashes(0, 3)) == {}
    stats = subscriber.stats("p")
    assert stats.restarts == 1
    assert stats.gaps_lost == 0


def test_all_blocks_cleared_empties_only_that_pod(
    make_publisher: MakePublisher, subscriber: KVEventSubscriber
) -> None:
    pub_a, pub_b = make_publisher("kv@a@m"), make_publisher("kv@b@m")
    subscriber.add_pod("a", pub_a.endpoint, pub_a.replay_endpoint)
    subscriber.add_pod("b", pub_b.endpoint, pub_b.replay_endpoint)
    make_live(pub_a, subscriber, "a")
    make_live(pub_b, subscriber, "b")
    pub_a.publish([chain(0, 4)])
    pub_b.publish([chain(0, 2)])
    wait_for(lambda: subscriber.longest_prefix_match(hashes(0, 4)) == {"a": 4, "b": 2}, message="both")
    pub_a.publish([AllBlocksCleared(), chain(0, 1)])
    wait_for(lambda: subscriber.longest_prefix_match(hashes(0, 4)) == {"a": 1, "b": 2}, message="a cleared")
    assert subscriber.stats("a").clears == 1


def test_remove_pod_drops_its_entries_and_socket(
    make_publisher: MakePublisher, subscriber: KVEventSubscriber
) -> None:
    pub = make_publisher()
    subscriber.add_pod("p", pub.endpoint, pub.replay_endpoint)
    make_live(pub, subscriber, "p")
    pub.publish([chain(0, 2)])
    wait_for(lambda: subscriber.longest_prefix_match(hashes(0, 2)) == {"p": 2}, message="indexed")
    subscriber.remove_pod("p")
    assert subscriber.longest_prefix_match(hashes(0, 2)) == {}
    assert subscriber.pods() == []
    pub.publish([chain(0, 2)])
    assert subscriber.index.pods() == set()
    with pytest.raises(KeyError, match="pod 'p' is not subscribed"):
        subscriber.stats("p")


def test_duplicate_pod_is_rejected(make_publisher: MakePublisher, subscriber: KVEventSubscriber) -> None:
    pub = make_publisher()
    subscriber.add_pod("p", pub.endpoint)
    with pytest.raises(ValueError, match="pod 'p' is already subscribed"):
        subscriber.add_pod("p", pub.endpoint)


def test_closed_subscriber_refuses_pods() -> None:
    sub = KVEventSubscriber()
    sub.close()
    sub.close()
    with pytest.raises(RuntimeError, match="KVEventSubscriber is closed"):
        sub.add_pod("p", "tcp://127.0.0.1:1")
