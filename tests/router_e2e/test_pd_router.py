"""A real P/D deployment behind a real `baton-router`: two producers, one consumer (SmolLM2, CPU,
float32), all `baton-engine serve` processes on 127.0.0.1 sharing one transfer key.

* parity: 16 prompts through the router give exactly the greedy text of one engine, including
  prompts that partly hit the consumer's prefix cache;
* a client that disconnects during a leg frees both sides (KV usage back to 0 on every engine);
* prefix routing under cache pressure beats round-robin (hit tokens read from the engines);
* the producer killed between the legs: the consumer recomputes and the request completes.

Forged or unsigned kv_transfer_params sent straight to a consumer (400, no outbound connection)
are covered engine-level in tests/kv_transfer/test_pd_http.py; through the router a client's
kv_transfer_params are dropped (tests/router), so only the router starts transfers.
The tests share one deployment and run in file order; the last one kills the producers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_engine import contract
from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.text.tokenizer import Tokenizer
from baton_support.wait import wait_for
from tests.pd_setup import PREFIXED, SHARED_PREFIX, TEXTS, common_prefix_len, pd_environment, serve_args
from tests.router_e2e.hooked_proxy import hooked_proxy
from tests.router_e2e.processes import (
    BLOCK_SIZE,
    KEY,
    MODEL,
    NAME,
    RouterProcess,
    chat,
    complete,
    counter,
    kv_event_ports,
    metric,
    port_of,
    stop_engines,
)
from tests.server.server_process import ServerProcess, pid_alive

# Three model loads and ~150 requests: over 10 minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]

# Cache pressure: a prompt is one 512-token prefix (32 blocks) plus a partial block of suffix.
# A producer holds 4 prefixes and a spare (5 x 32 + 1 = 161 <= 164), so a 5/3 split of the cold
# prefixes (load ties broken by stale scrapes) still fits; 8 prefixes (256 blocks) never do.
PREFIXES, SUFFIXES, PREFIX_TOKENS = 8, 8, 512
PRODUCER_BLOCKS = 164
LEASE_SECONDS = 60  # long: a lease freed well before it expires was released by a disconnect


class Deployment:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.events = [kv_event_ports(), kv_event_ports()]
        self.producers = [
            ServerProcess(
                MODEL,
                *serve_args(
                    "producer", num_kv_blocks=PRODUCER_BLOCKS, lease_seconds=LEASE_SECONDS, name=NAME
                ),
                *events,
                log_path=log_dir / f"producer{i}.log",
                wait_ready=False,
            )
            for i, events in enumerate(self.events)
        ]
        self.consumer = ServerProcess(
            MODEL,
            *serve_args("consumer", num_kv_blocks=600, lease_seconds=LEASE_SECONDS, name=NAME),
            log_path=log_dir / "consumer.log",
            wait_ready=False,
        )
        for engine in self.engines:
            engine.wait_ready()
        self.tokenizer: Tokenizer = load_tokenizer(MODEL)

    @property
    def engines(self) -> list[ServerProcess]:
        return [*self.producers, self.consumer]

    def prefill_urls(self) -> list[str]:
        return [
            f"{p.url}#{contract.PORT_KV_EVENTS}={port_of(e, '--kv-events-port')},"
            f"{contract.PORT_KV_EVENTS_REPLAY}={port_of(e, '--kv-events-replay-port')}"
            for p, e in zip(self.producers, self.events, strict=True)
        ]

    def router(self, name: str, *args: str, decode_url: str | None = None) -> RouterProcess:
        return RouterProcess(
            "--prefill", *self.prefill_urls(), "--decode", decode_url or self.consumer.url,
            "--tokenizer", MODEL, "--prefix-hash", "fast", "--block-size", str(BLOCK_SIZE),
            # A timed-out scrape ranks a producer last (unknown load): allow a loaded engine 5 s.
            "--scrape-interval", "0.5", "--scrape-timeout", "5", *args,
            log_path=self.log_dir / f"router-{name}.log",
        )  # fmt: skip

    def wait_all_idle(self) -> None:
        wait_kv_free(self.engines, timeout=30)


def wait_kv_free(engines: list[ServerProcess], timeout: float) -> None:
    """Every engine idle with no KV block in use, and its /metrics KV usage back to 0."""
    for engine in engines:
        engine.wait_idle(timeout=timeout)
        wait_for(
            lambda url=engine.url: metric(url, contract.M_KV_USAGE) == 0.0,
            timeout=60,
            message=f"{engine.url} KV usage 0",
        )


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with pd_environment(KEY):
        started: Deployment | None = None
        try:
            started = Deployment(tmp_path_factory.mktemp("pd-router"))
            yield started
        finally:
            if started is not None:
                stop_engines(started.engines)


# --------------------------------------------------------------------------- parity

CHATS = ["Name a famous painting by Leonardo da Vinci.", "What are the three laws of thermodynamics?"]


def _chat_text(url: str, content: str) -> str:
    return str(
        chat(url, [{"role": "user", "content": content}], max_tokens=8)["choices"][0]["message"]["content"]
    )


def _text(url: str, prompt: str) -> str:
    return str(complete(url, prompt, max_tokens=8)["choices"][0]["text"])


def test_pd_through_router_matches_one_engine(deployment: Deployment) -> None:
    reference_engine = deployment.producers[0].url  # no kv_transfer_params: it serves as one engine
    prompts = TEXTS[:12] + [SHARED_PREFIX + s for s in PREFIXED]
    expected = [_text(reference_engine, p) for p in prompts] + [
        _chat_text(reference_engine, c) for c in CHATS
    ]
    assert len(expected) == 16

    router = deployment.router("parity")
    try:
        _text(router.url, SHARED_PREFIX + "Question: warm the consumer's cache.")
        consumer_hits = counter(deployment.consumer.url, contract.M_PREFIX_HITS)
        got = [_text(router.url, p) for p in prompts] + [_chat_text(router.url, c) for c in CHATS]
        assert got == expected
        # the two prefixed prompts reuse the consumer's cached blocks of SHARED_PREFIX
        tok = deployment.tokenizer
        warm_ids = tok.encode(SHARED_PREFIX + "Question: warm the consumer's cache.")
        shared_blocks = []
        for suffix in PREFIXED:
            ids = tok.encode(SHARED_PREFIX + suffix)
            shared_blocks.append(common_prefix_len(ids, warm_ids) // BLOCK_SIZE)
        assert min(shared_blocks) >= 2
        wait_for(
            lambda: (
                counter(deployment.consumer.url, contract.M_PREFIX_HITS) - consumer_hits
                >= sum(shared_blocks) * BLOCK_SIZE
            ),
            timeout=60,
            message="the consumer's prefix hits on the shared prefix",
        )
        assert counter(router.url, contract.M_ROUTER_FALLBACKS) == 0.0
        # The router counts a request after its response's last byte went out.
        wait_for(
            lambda: counter(router.url, contract.M_ROUTER_REQUESTS) == 17.0,
            timeout=60,
            message="the router to count 17 requests",
        )
    finally:
        router.stop()
    deployment.wait_all_idle()


# --------------------------------------------------------------------------- client disconnect


def _send_raw(url: str, path: str, body: dict[str, Any], request_id: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def _running(engine: ServerProcess) -> int:
    return int(engine.stats()["num_running"])


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_client_disconnect_mid_leg_frees_both_sides(deployment: Deployment, leg: str) -> None:
    expired = [counter(p.url, contract.M_KV_LEASES_EXPIRED) for p in deployment.producers]
    router = deployment.router(f"disconnect-{leg}")
    try:
        if leg == "prefill":
            # a long prompt: the prefill leg runs for a while on the producer
            prompt = " ".join(f"item{i} costs {i * 7 % 13} coins;" for i in range(100))
            request_id = f"disconnect-prefill-{os.getpid()}"
            body = {"model": NAME, "prompt": prompt, "max_tokens": 4}
            sock = _send_raw(router.url, "/v1/completions", body, request_id)
            # The core is busy for the whole prefill step (stats calls wait for it), so the sign
            # that the leg runs is the producer's server logging the request on arrival.
            arrived = f"request {request_id}: completion"
            wait_for(
                lambda: any(arrived in p.log_text() for p in deployment.producers),
                timeout=60,
                message="the prefill leg to reach a producer",
            )
        else:
            body = {
                "model": NAME,
                "prompt": "Count slowly:",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            sock = _send_raw(router.url, "/v1/completions", body, f"disconnect-decode-{os.getpid()}")
            received = b""
            while b"data: {" not in received:  # the consumer is streaming the decode leg
                chunk = sock.recv(65536)
                assert chunk, f"router closed the stream early: {received!r}"
                received += chunk
            assert _running(deployment.consumer) == 1
        sock.close()
        # freed before the producer's 60 s lease could expire (a busy core finishes its step first)
        wait_kv_free(deployment.engines, timeout=45)
        for engine in deployment.engines:
            stats = engine.stats()
            assert (stats["num_used_kv_blocks"], stats["kv_leases_held"]) == (0, 0), engine.url
        assert [counter(p.url, contract.M_KV_LEASES_EXPIRED) for p in deployment.producers] == expired
    finally:
        router.stop()


# --------------------------------------------------------------------------- prefix routing


def _prefix_texts(tok: Tokenizer, seed: int) -> list[str]:
    """8 distinct documents of at least PREFIX_TOKENS tokens each."""
    rng = random.Random(seed)
    words = (
        "river mountain ledger copper signal harbour orchard lantern meadow engine thimble quartz "
        "violet saddle canyon biscuit compass falcon"
    ).split()
    texts = []
    for k in range(PREFIXES):
        parts = [f"Document {seed}-{k}."]
        while len(tok.encode(" ".join(parts))) < PREFIX_TOKENS:
            parts.append(rng.choice(words))
        texts.append(" ".join(parts) + ".")
    return texts


def _workload(tok: Tokenizer, seed: int) -> tuple[list[str], int]:
    """Prompts in a fixed prefix-rotating order, and the ideal prefix-hit tokens for them.

    Round r sends suffix r of every prefix, prefixes in the order r, r+1, ... (mod 8): the shift
    keeps round-robin from pinning each prefix to one engine by accident (an unshifted rotation
    of 8 prefixes over 2 engines would give every engine the same 4 prefixes forever).
    Ideal: every request after a prefix's first one hits that prefix's shared full blocks.
    """
    docs = _prefix_texts(tok, seed)
    prompts, ideal = [], 0
    for r in range(SUFFIXES):
        for j in range(PREFIXES):
            k = (r + j) % PREFIXES
            prompts.append(f"{docs[k]}\nQuestion {r}: what is item {r * 3 + k} about?")
    for k in range(PREFIXES):
        ids = [tok.encode(p) for p in prompts if p.startswith(docs[k] + "\n")]
        common = min(common_prefix_len(x, ids[0]) for x in ids[1:])
        assert common >= PREFIX_TOKENS
        ideal += (SUFFIXES - 1) * (common // BLOCK_SIZE) * BLOCK_SIZE
    return prompts, ideal


def _hit_tokens_of_run(deployment: Deployment, routing: str, seed: int) -> tuple[float, int]:
    prompts, ideal = _workload(deployment.tokenizer, seed)
    before = sum(counter(p.url, contract.M_PREFIX_HITS) for p in deployment.producers)
    done_before = sum(counter(p.url, contract.M_REQUEST_SUCCESS) for p in deployment.producers)
    router = deployment.router(routing, "--routing", routing)
    try:
        for prompt in prompts:
            complete(router.url, prompt, max_tokens=1)
    finally:
        router.stop()
    wait_for(
        lambda: (
            sum(counter(p.url, contract.M_REQUEST_SUCCESS) for p in deployment.producers)
            == done_before + len(prompts)
        ),
        timeout=60,
        message="the producers' metrics to count every request",
    )
    return sum(counter(p.url, contract.M_PREFIX_HITS) for p in deployment.producers) - before, ideal


def test_prefix_routing_under_cache_pressure(deployment: Deployment) -> None:
    prefix_hits, ideal = _hit_tokens_of_run(deployment, "prefix", seed=1)
    # 8 prefixes x 7 repeats x 32 full blocks of 16 tokens (the suffixes diverge right after them)
    assert ideal == PREFIXES * (SUFFIXES - 1) * PREFIX_TOKENS
    round_robin_hits, rr_ideal = _hit_tokens_of_run(deployment, "round-robin", seed=2)
    assert rr_ideal == ideal
    print(f"prefix-aware hits {prefix_hits:.0f}, round-robin {round_robin_hits:.0f}, ideal {ideal}")
    assert prefix_hits >= 0.8 * ideal
    assert prefix_hits >= 3 * round_robin_hits
    deployment.wait_all_idle()


# --------------------------------------------------------------------------- producer killed (last)


def test_producer_killed_between_the_legs_completes(deployment: Deployment) -> None:
    # several full blocks the consumer has never seen, so it must pull them from the producer
    prompt = (
        "A geography quiz for travellers crossing the Sahara by train, bus and camel, with three "
        "questions on rivers, deserts and mountains of the African continent. First question: "
        "the longest river in Africa is"
    )
    assert len(deployment.tokenizer.encode(prompt)) >= 2 * BLOCK_SIZE
    expected = _text(deployment.producers[0].url, prompt)  # no kv_transfer_params: one engine
    failures = counter(deployment.consumer.url, contract.M_KV_TRANSFER_FAILURES)
    killed: list[int] = []

    # the engine core holds the blocks and the transfer socket: kill it with its server
    pids = [pid for p in deployment.producers for pid in (p.pid, int(p.stats()["core_pid"]))]

    def kill_producers(body: bytes) -> None:
        if killed or b"kv_transfer_params" not in body:
            return
        for pid in pids:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            wait_for(lambda pid=pid: not pid_alive(pid), timeout=30, message=f"producer process {pid} to die")

    proxy = hooked_proxy(deployment.consumer.url, kill_producers)
    router = deployment.router("kill", decode_url=proxy.url)
    try:
        assert _text(router.url, prompt) == expected
        assert len(killed) == 4 and not any(pid_alive(pid) for pid in killed)
        wait_for(
            lambda: counter(deployment.consumer.url, contract.M_KV_TRANSFER_FAILURES) == failures + 1,
            timeout=60,
            message="the consumer to count the failed pull",
        )
        deployment.consumer.wait_idle(timeout=20)
    finally:
        router.stop()
        proxy.stop()
