"""Prefix routing fed by real KV events: Baton's publisher -> the router's subscriber and index."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import cbor2
import httpx
import pytest

from baton_engine import contract
from baton_engine.prefix.hashing import EventKeyHasher, fast_prefix_hash
from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.vllm_hash import VllmPrefixHasher, VllmSha256CborHasher
from baton_engine.router.endpoints import Endpoint, EndpointRegistry
from baton_engine.router.kv_index import KVEventIndex, zmq_address
from baton_engine.router.prefix import PrefixScorer
from baton_support.wait import wait_for
from tests.prefix.records import BlocksStored

BLOCK = 16
PROMPT = list(range(1000, 1000 + 3 * BLOCK + 5))  # three full blocks and a partial one


def _digest(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def test_block_keys_chain_vllm_digests_and_keep_their_low_64_bits() -> None:
    root = _digest("7")
    first = _digest((root, tuple(PROMPT[:BLOCK]), None))
    second = _digest((first, tuple(PROMPT[BLOCK : 2 * BLOCK]), None))
    third = _digest((second, tuple(PROMPT[2 * BLOCK : 3 * BLOCK]), None))
    hasher = EventKeyHasher(VllmSha256CborHasher("7"), BLOCK)
    assert hasher.block_hashes(PROMPT) == [int.from_bytes(d[-8:], "big") for d in (first, second, third)]
    assert hasher.block_hashes(PROMPT[: BLOCK - 1]) == []


def test_block_hasher_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    vllm = EventKeyHasher.named("vllm-sha256-cbor", BLOCK)
    assert isinstance(vllm.hasher, VllmPrefixHasher) and vllm.block_size == BLOCK
    assert vllm.block_hashes(PROMPT) == EventKeyHasher(VllmSha256CborHasher("7"), BLOCK).block_hashes(PROMPT)
    seeded = EventKeyHasher.named("vllm-sha256-cbor", BLOCK, seed="8").block_hashes(PROMPT)
    assert (
        seeded
        == EventKeyHasher(VllmSha256CborHasher("8"), BLOCK).block_hashes(PROMPT)
        != vllm.block_hashes(PROMPT)
    )
    assert EventKeyHasher.named("fast", BLOCK).hasher is fast_prefix_hash
    with pytest.raises(
        ValueError, match="prefix hash: 'fastest' is not one of fast, vllm-sha256, vllm-sha256-cbor"
    ):
        EventKeyHasher.named("fastest", BLOCK)


def test_zmq_addresses() -> None:
    v4 = Endpoint(role="prefill", url="http://10.0.0.1:8000", ports={"kv-events": 7001})
    v6 = Endpoint(role="prefill", url="http://[fd00::1]:8000")
    assert zmq_address(v4, contract.PORT_KV_EVENTS) == "tcp://10.0.0.1:7001"
    assert zmq_address(v4, contract.PORT_KV_EVENTS_REPLAY) == "tcp://10.0.0.1:5558"
    assert zmq_address(v6, contract.PORT_KV_EVENTS) == "tcp://[fd00::1]:5557"


def _port(zmq_endpoint: str) -> int:
    return int(zmq_endpoint.rsplit(":", 1)[1])


@pytest.fixture
def publishers() -> Iterator[list[KVEventPublisher]]:
    made = [
        KVEventPublisher("tcp://127.0.0.1:*", "kv@pod@smollm2", replay_endpoint="tcp://127.0.0.1:*")
        for _ in range(2)
    ]
    yield made
    for publisher in made:
        publisher.shutdown()


def _endpoint(role: str, url: str, publisher: KVEventPublisher) -> Endpoint:
    assert publisher.replay_endpoint is not None
    ports = {"kv-events": _port(publisher.endpoint), "kv-replay": _port(publisher.replay_endpoint)}
    return Endpoint(role=role, url=url, ports=ports)


def _store(publisher: KVEventPublisher, hasher: VllmSha256CborHasher, tokens: list[int]) -> None:
    parent, hashes = None, []
    for start in range(0, len(tokens), BLOCK):
        parent = hasher(parent, tuple(tokens[start : start + BLOCK]))
        hashes.append(parent)
    publisher.publish([BlocksStored(tuple(hashes), None, tuple(tokens), BLOCK)])


def _until(condition: Callable[[], bool], publishers: list[KVEventPublisher], what: str) -> None:
    """Wait for ``condition``; meanwhile keep the streams going with unrelated blocks, as live engines
    do: a subscription still joining (ZMQ's slow joiner) misses the first batches, and the next one it
    sees makes it replay them from the publisher's buffer."""
    filler = iter(range(10**6))

    def poll() -> bool:
        if condition():
            return True
        for publisher in publishers:
            n = next(filler)
            publisher.publish([BlocksStored((2**60 + n,), None, tuple(range(BLOCK)), BLOCK)])
        return False

    wait_for(poll, message=what)


def test_index_follows_pods_and_drops_a_pod_that_goes(publishers) -> None:
    hasher = VllmSha256CborHasher("7")
    keys = EventKeyHasher(hasher, BLOCK).block_hashes(PROMPT)
    registry = EndpointRegistry()
    index = KVEventIndex()
    try:
        index.attach(registry)
        pod = _endpoint("prefill", "http://127.0.0.1:1", publishers[0])
        registry.upsert(pod)
        registry.upsert(
            _endpoint("decode", "http://127.0.0.1:2", publishers[1])
        )  # decode pods are not indexed
        wait_for(lambda: index.subscriber.pods() == [pod.key], message="subscription to the prefill pod")
        _store(publishers[0], hasher, PROMPT[: 2 * BLOCK])
        _until(
            lambda: index.longest_prefix_match(keys) == {pod.key: 2},
            publishers[:1],
            "stored blocks in the index",
        )

        registry.remove(pod.key)
        wait_for(lambda: index.subscriber.pods() == [], message="unsubscription")
        assert index.longest_prefix_match(keys) == {}
    finally:
        index.close()


def test_router_prefills_where_the_events_say_the_prefix_is(start_engine, start_router, publishers) -> None:
    cold, cold_url = start_engine("cold")
    warm, warm_url = start_engine("warm")
    decode, decode_url = start_engine("d0")
    hasher = VllmSha256CborHasher("7")
    keys = EventKeyHasher(hasher, BLOCK).block_hashes(PROMPT)
    index = KVEventIndex()
    cold_pod = _endpoint("prefill", cold_url, publishers[0])
    warm_pod = _endpoint("prefill", warm_url, publishers[1])
    router = start_router(
        endpoints=[cold_pod, warm_pod],
        decode=[decode_url],
        scorer=PrefixScorer(hasher=EventKeyHasher(hasher, BLOCK), index=index),
        kv_index=index,
        block_size=BLOCK,
    )
    wait_for(lambda: len(index.subscriber.pods()) == 2, message="subscriptions to both prefill pods")
    _store(publishers[0], hasher, PROMPT[:BLOCK])
    _store(publishers[1], hasher, PROMPT[: 3 * BLOCK])
    both = {cold_pod.key: 1, warm_pod.key: 3}
    _until(lambda: index.longest_prefix_match(keys) == both, publishers, "both pods' blocks in the index")

    for _ in range(2):
        response = httpx.post(
            router.url + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT}, timeout=30
        )
        assert response.status_code == 200
    assert (len(cold.posts()), len(warm.posts()), len(decode.posts())) == (0, 2, 2)
    hit_tokens = 2 * 3 * BLOCK  # two requests, three cached blocks each
    assert (
        f"baton_router_prefix_hit_tokens_total {hit_tokens}.0"
        in httpx.get(router.url + "/metrics", timeout=30).text
    )
