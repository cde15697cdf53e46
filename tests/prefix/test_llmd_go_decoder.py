"""Acceptance: llm-d's own Go code reads Baton's KV events and computes Baton's vLLM keys.

The Go program (``go_decoder/``) links llm-d-kv-cache v0.8.1's vLLM engine adapter (the
decoder its indexer runs on every vLLM event) and llm-d-kv-cache-manager v0.4.0's token
processor (the last llm-d release that computes vLLM's own sha256-cbor keys from prompts;
later ones compute their own keys and learn engine keys from events).

Note: that adapter rejects a block hash msgpack writes in fewer than 8 bytes ("unsupported hash
type: int8"); real 64-bit hashes are below 2**32 with probability 2**-32, so the events here use
real ones.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from baton_engine.contract import kv_events_topic
from baton_engine.prefix.hashing import to_event_hash
from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.vllm_hash import VllmSha256CborHasher
from baton_engine.prefix.wire import REPLAY_END_SEQ
from baton_support.wait import wait_for
from tests.prefix.records import AllBlocksCleared, BlocksRemoved, BlocksStored

MakePublisher = Callable[..., KVEventPublisher]
TOPIC = kv_events_topic("10.244.1.17", "smollm2-135m-instruct")
BLOCK = 4
HASHER = VllmSha256CborHasher("0")


def vllm_chain(tokens: list[int], block_size: int = BLOCK) -> list[bytes]:
    keys: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = HASHER(parent, tuple(tokens[start : start + block_size]))
        keys.append(parent)
    return keys


PROMPT = [151643, 9, 2, 77, 1, 1, 1, 1, 65535, 70000, 3, 4]  # three full blocks
KEYS = vllm_chain(PROMPT)
EVENT_KEYS = [to_event_hash(k) for k in KEYS]


def stored_event(hashes: list[int], parent: int, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "event": {
            "BlockHashes": hashes,
            "Tokens": tokens,
            "ParentHash": parent,  # llm-d reads a nil parent as 0
            "DeviceTier": "GPU",
            "LoraID": None,
            "LoraName": None,
            "ExtraKeys": [None] * len(hashes),
        },
    }


def batch_out(seq: int, ts: float, events: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seq": seq,
        "topic": "kv@10.244.1.17@smollm2-135m-instruct",
        "pod_id": "10.244.1.17",
        "model_name": "smollm2-135m-instruct",
        "ts": ts,
        "events": events,
    }


# The three batches each test publishes, and what llm-d must decode from them.
BATCHES: list[tuple[float, list[object]]] = [
    (1764470000.25, [BlocksStored(tuple(KEYS[:2]), None, tuple(PROMPT[:8]), BLOCK)]),
    (
        1764470000.5,
        [BlocksStored((KEYS[2],), KEYS[1], tuple(PROMPT[8:12]), BLOCK), BlocksRemoved((KEYS[0],))],
    ),
    (1764470001.0, [AllBlocksCleared()]),
]
DECODED = [
    [stored_event(EVENT_KEYS[:2], 0, PROMPT[:8])],
    [
        stored_event(EVENT_KEYS[2:], EVENT_KEYS[1], PROMPT[8:12]),
        {"type": "BlockRemoved", "event": {"BlockHashes": EVENT_KEYS[:1], "DeviceTier": "GPU"}},
    ],
    [{"type": "AllBlocksCleared", "event": {"DeviceTier": ""}}],
]


class GoSubscriber:
    """The Go program in subscribe mode; its JSON lines arrive on a queue."""

    def __init__(self, binary: Path, endpoint: str) -> None:
        self.proc = subprocess.Popen(
            [str(binary), "-mode", "subscribe", "-endpoint", endpoint, "-topic", "kv@"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.next_line(30) == "ready"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            stderr = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
            raise AssertionError(f"no output from the Go subscriber in {timeout} s {stderr}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def go_subscriber(go_decoder: Path) -> Iterator[Callable[[str], GoSubscriber]]:
    started: list[GoSubscriber] = []

    def start(endpoint: str) -> GoSubscriber:
        sub = GoSubscriber(go_decoder, endpoint)
        started.append(sub)
        return sub

    yield start
    for sub in started:
        sub.stop()


def go_decode(binary: Path, frames: list[list[bytes]]) -> list[dict[str, Any]]:
    lines = "".join(
        json.dumps({"topic": t.decode(), "seq_hex": s.hex(), "payload_hex": p.hex()}) + "\n"
        for t, s, p in frames
    )
    out = subprocess.run(
        [str(binary), "-mode", "decode"], input=lines, capture_output=True, text=True, check=True, timeout=60
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def replay_frames(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a publisher's replay socket for batches from `start`; returns [topic, seq, payload] triples."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(5000), "no replay reply"
            _, seq, payload = dealer.recv_multipart()
            if seq == REPLAY_END_SEQ:
                return frames
            frames.append([TOPIC.encode(), seq, payload])
    finally:
        ctx.destroy(linger=0)


def test_llmd_subscriber_decodes_live_batches(make_publisher: MakePublisher, go_subscriber: Any) -> None:
    pub = make_publisher(TOPIC)
    go = go_subscriber(pub.endpoint)
    # Probe until the Go SUB socket's subscription has reached the publisher.
    probes = 0

    def probe() -> dict[str, Any] | None:
        nonlocal probes
        pub.publish([BlocksRemoved((2**63 + probes,))], ts=1.0)
        probes += 1
        try:
            line: dict[str, Any] = json.loads(go.lines.get(timeout=0.05))
            return line
        except queue.Empty:
            return None

    first = wait_for(probe, interval=0, message="the Go subscriber to receive a probe")
    assert first["events"][0]["type"] == "BlockRemoved"
    assert first["seq"] < probes
    for ts, records in BATCHES:
        pub.publish(records, ts=ts)
    received: dict[int, dict[str, Any]] = {}
    while len(received) < len(BATCHES):
        line = json.loads(go.next_line(10))
        if line["seq"] >= probes:
            received[line["seq"]] = line
    assert [received[probes + i] for i in range(len(BATCHES))] == [
        batch_out(probes + i, ts, DECODED[i]) for i, (ts, _) in enumerate(BATCHES)
    ]


def test_llmd_decodes_a_replay_from_a_midpoint_and_a_restarted_stream(
    make_publisher: MakePublisher, go_decoder: Path
) -> None:
    first = make_publisher(TOPIC, buffer_steps=100)
    for ts, records in BATCHES:
        first.publish([BlocksRemoved((2**63,))], ts=ts - 0.125)
        first.publish(records, ts=ts)
    replay_endpoint = first.replay_endpoint or ""

    replayed = wait_for(
        lambda: frames if len(frames := replay_frames(replay_endpoint, 3)) == 3 else None,
        message="the replay of batches 3..5",
    )
    decoded = go_decode(go_decoder, replayed)
    removed_probe = [{"type": "BlockRemoved", "event": {"BlockHashes": [2**63], "DeviceTier": "GPU"}}]
    assert decoded == [
        batch_out(3, BATCHES[1][0], DECODED[1]),
        batch_out(4, BATCHES[2][0] - 0.125, removed_probe),
        batch_out(5, BATCHES[2][0], DECODED[2]),
    ]

    endpoint = first.endpoint
    first.shutdown()
    restarted = make_publisher(TOPIC, endpoint=endpoint, replay_endpoint=replay_endpoint)
    restarted.publish(BATCHES[0][1], ts=BATCHES[0][0])
    frames = wait_for(lambda: replay_frames(replay_endpoint, 0), message="the restarted stream's replay")
    assert go_decode(go_decoder, frames) == [batch_out(0, BATCHES[0][0], DECODED[0])]


@pytest.mark.parametrize(
    ("seed", "block_size", "tokens"),
    [
        ("0", 16, list(range(1000, 1040))),  # two full blocks, partial tail ignored
        ("12345", 4, [151643, 0, 1, 2**31 - 1, 23, 24, 255, 256, 65535, 65536, 7, 7]),
        ("", 1, [5, 4, 3]),
        ("baton", 8, [42] * 8),
    ],
)
def test_vllm_keys_match_llmd_token_processor(
    go_decoder: Path, seed: str, block_size: int, tokens: list[int]
) -> None:
    out = subprocess.run(
        [str(go_decoder), "-mode", "hash", "-seed", seed, "-block-size", str(block_size)],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    llmd_keys = json.loads(out.stdout)
    hasher = VllmSha256CborHasher(seed)
    ours: list[int] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hasher(parent, tuple(tokens[start : start + block_size]))
        ours.append(to_event_hash(parent))
    assert len(ours) == len(tokens) // block_size
    assert llmd_keys == ours
