"""The router's block keys for a chat request equal the keys in the engine's KV events.

A real `baton-engine serve` (SmolLM2, CPU) publishes KV events; the router's request tokenizer
(loaded torch-free from the same model reference) and its block hasher compute the keys of the
same chat request; both hashes the engines offer are checked. Then a real `baton-router` in front
of that engine reports every prompt block of a repeated request as a prefix hit, so the running
router process computes the same keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_engine import contract
from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.prefix.wire import WireBlockStored
from baton_engine.router.request_tokens import EngineRequestTokenizer
from baton_support.wait import wait_for
from tests.router_e2e.processes import (
    BLOCK_SIZE,
    MODEL,
    RouterProcess,
    chat,
    kv_event_ports,
    metric,
    port_of,
    replayed_block_stored,
    start_engine,
    stop_engines,
)
from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model]

PARTS = [
    {"type": "text", "text": "Which trains leave Zurich for Geneva "},
    {"type": "text", "text": "before nine in the morning, and how long do they take?"},
]
MESSAGES = [
    {
        "role": "system",
        "content": "You are a terse assistant for a railway timetable office. Answer with departure times, "
        "platforms and travel durations only, and say so when a connection needs a change of trains.",
    },
    {"role": "user", "content": PARTS},  # text parts: joined by the engine and the router alike
]
SEED = "4242"


@pytest.fixture(params=["fast", "vllm-sha256-cbor"])
def engine(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ServerProcess, str, tuple[str, ...]]]:
    monkeypatch.setenv("PYTHONHASHSEED", SEED)  # the engine inherits it; the test's hasher reads it
    events = kv_event_ports()
    server = start_engine(
        "--prefix-hash", request.param, "--num-kv-blocks", "64", *events, log_path=tmp_path / "engine.log"
    )
    try:
        yield server, request.param, events
    finally:
        stop_engines([server])


def test_router_keys_equal_engine_event_keys(
    engine: tuple[ServerProcess, str, tuple[str, ...]], tmp_path: Path
) -> None:
    server, prefix_hash, events = engine
    body = {"messages": MESSAGES}
    token_ids = EngineRequestTokenizer(load_tokenizer(MODEL)).prompt_token_ids("chat", body)
    hasher = EventKeyHasher.named(prefix_hash, BLOCK_SIZE)
    assert hasher is not None
    router_keys = hasher.block_hashes(token_ids)
    full_blocks = len(token_ids) // BLOCK_SIZE
    assert len(router_keys) == full_blocks >= 3

    answer = chat(server.url, MESSAGES, max_tokens=1)
    assert answer["usage"]["prompt_tokens"] == len(token_ids)
    replay_port = port_of(events, "--kv-events-replay-port")

    def prompt_blocks_published() -> list[WireBlockStored] | None:
        # The core hands the step's events to its publisher thread, which buffers them a moment
        # after the response may have left.
        stored, _ = replayed_block_stored(replay_port)
        return stored if sum(len(event.block_hashes) for event in stored) >= full_blocks else None

    stored = wait_for(
        prompt_blocks_published, timeout=30, message="the engine to publish the prompt's blocks"
    )
    engine_keys = [key for event in stored for key in event.block_hashes]
    engine_tokens = [token for event in stored for token in event.token_ids]
    # the generated token may complete one more block; the prompt's blocks come first
    assert engine_keys[:full_blocks] == router_keys
    assert engine_tokens[: full_blocks * BLOCK_SIZE] == token_ids[: full_blocks * BLOCK_SIZE]

    router = RouterProcess(
        "--mode", "aggregated", "--engine", server.url,
        "--kv-events-port", str(port_of(events, "--kv-events-port")),
        "--kv-replay-port", str(port_of(events, "--kv-events-replay-port")),
        "--tokenizer", MODEL, "--prefix-hash", prefix_hash, "--block-size", str(BLOCK_SIZE),
        log_path=tmp_path / "router.log",
    )  # fmt: skip
    try:
        hits = contract.M_ROUTER_PREFIX_HIT_TOKENS
        # The router replays the engine's buffered events once it sees a live one (any new
        # request's); wait until it has applied every batch the engine published.
        chat(router.url, [{"role": "user", "content": "Wake the event stream."}], max_tokens=1)
        _, last_seq = replayed_block_stored(port_of(events, "--kv-events-replay-port"))
        wait_for(
            lambda: _router_next_seq(router) > last_seq,
            timeout=30,
            message=f"the router to apply KV-event batch {last_seq}",
        )
        before = metric(router.url, hits)
        chat(router.url, MESSAGES, max_tokens=1)
        assert metric(router.url, hits) - before == full_blocks * BLOCK_SIZE
    finally:
        router.stop()


def _router_next_seq(router: RouterProcess) -> float:
    try:
        return metric(router.url, contract.M_ROUTER_KV_EVENTS_NEXT_SEQ)
    except AssertionError:  # not subscribed yet
        return -1.0
