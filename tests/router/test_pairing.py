"""Prefill pods are paired only with decode pods of their KV-compatibility key (the label the
operator puts on every engine pod), and each pod's prompts are hashed its own way."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from baton_engine import contract
from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.router.discovery import endpoint_from_pod
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, static_endpoint
from baton_engine.router.prefix import PrefixScorer, block_hasher
from baton_support.wait import wait_for
from tests.router.test_discovery import POD, _pod
from tests.router.test_prefix_routing import DictIndex
from tests.router.test_proxy import _wait_metric

BODY = {"model": "smollm2", "prompt": "Hello", "max_tokens": 5, "temperature": 0}


def test_pod_label_and_annotations_become_the_endpoints_key_and_hashing() -> None:
    pod = _pod(
        metadata__labels={**POD["metadata"]["labels"], contract.LABEL_KV_COMPAT: "aecfc482d86753bf"},
        metadata__annotations={contract.ANNOTATION_BLOCK_SIZE: "32", contract.ANNOTATION_PREFIX_HASH: "fast"},
    )
    endpoint = endpoint_from_pod(pod, "prefill")
    assert endpoint is not None
    assert (endpoint.kv_key, endpoint.block_size, endpoint.prefix_hash) == ("aecfc482d86753bf", 32, "fast")
    assert endpoint.prefix_hash_seed is None
    seeded = endpoint_from_pod(
        _pod(
            metadata__annotations={
                contract.ANNOTATION_PREFIX_HASH: "vllm-sha256",
                contract.ANNOTATION_PREFIX_HASH_SEED: "7",
            }
        ),
        "prefill",
    )
    assert seeded is not None and (seeded.prefix_hash, seeded.prefix_hash_seed) == ("vllm-sha256", "7")


def test_pods_without_the_label_or_with_unusable_annotations() -> None:
    plain = endpoint_from_pod(POD, "decode")
    assert plain is not None and (plain.kv_key, plain.block_size, plain.prefix_hash) == ("", None, None)
    bad = endpoint_from_pod(
        _pod(
            metadata__annotations={
                contract.ANNOTATION_BLOCK_SIZE: "-4",
                contract.ANNOTATION_PREFIX_HASH: "md5",
            }
        ),
        "decode",
    )
    assert bad is not None and (bad.block_size, bad.prefix_hash) == (None, None)


def test_static_url_fragment_sets_the_key() -> None:
    endpoint = static_endpoint("prefill", "127.0.0.1:8001#kv-events=5601,kv-key=k1")
    assert (endpoint.url, endpoint.kv_key, endpoint.ports) == (
        "http://127.0.0.1:8001",
        "k1",
        {"kv-events": 5601},
    )


def test_a_relabelled_pod_is_replaced_in_the_registry() -> None:
    registry = EndpointRegistry()
    events: list[tuple[str, str]] = []
    registry.subscribe(lambda kind, e: events.append((kind, e.kv_key)))
    old = Endpoint(role="decode", url="http://10.0.0.1:8000", uid="u1", kv_key="k1")
    registry.upsert(old)
    registry.upsert(old)  # no change: no event
    registry.upsert(Endpoint(role="decode", url="http://10.0.0.1:8000", uid="u1", kv_key="k2"))
    assert events == [("added", "k1"), ("removed", "k1"), ("added", "k2")]
    assert [e.kv_key for e in registry.by_role("decode")] == ["k2"]
    assert registry.by_role("decode", "k1") == []


def _decode_of(engines: dict[str, Any]) -> dict[str, str]:
    """request id -> name of the decode engine that got its decode leg."""
    return {
        r.request_id: name
        for name, engine in engines.items()
        for r in engine.posts()
        if "kv_transfer_params" in r.body and not r.body["kv_transfer_params"].get("do_remote_decode")
    }


def _prefill_of(engines: dict[str, Any]) -> dict[str, str]:
    return {
        r.request_id: name
        for name, engine in engines.items()
        for r in engine.posts()
        if (r.body.get("kv_transfer_params") or {}).get("do_remote_decode")
    }


def test_every_decode_leg_goes_to_a_pod_of_the_prefill_pods_key(start_engine, start_router) -> None:
    """Two generations side by side (as mid-rollout): 24 requests, each paired within its key,
    and both keys get traffic."""
    engines, endpoints = {}, []
    for name, role, key in [("p-old", "prefill", "k1"), ("p-new", "prefill", "k2"),
                            ("d-old", "decode", "k1"), ("d-new", "decode", "k2")]:  # fmt: skip
        engines[name], url = start_engine(name)
        endpoints.append(Endpoint(role=role, url=url, name=name, kv_key=key))
    router = start_router(endpoints=endpoints, routing="round-robin")

    def send(i: int) -> int:
        headers = {"X-Request-Id": f"r{i}"}
        return httpx.post(router.url + "/v1/completions", json=BODY, headers=headers, timeout=30).status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(send, range(24))) == [200] * 24

    prefill_of, decode_of = _prefill_of(engines), _decode_of(engines)
    assert sorted(prefill_of) == sorted(decode_of) == sorted(f"r{i}" for i in range(24))
    pairs = {(prefill_of[r], decode_of[r]) for r in prefill_of}
    assert pairs == {("p-old", "d-old"), ("p-new", "d-new")}


def test_prefill_pods_whose_key_has_no_decode_pod_are_skipped(start_engine, start_router) -> None:
    """Old prefill, new decode (a decode-first rollout that ran ahead): requests go whole to the
    decode pod, counted as no_paired_prefill fallbacks; the prefill pod gets nothing."""
    prefill, prefill_url = start_engine("p-old")
    decode, decode_url = start_engine("d-new")
    router = start_router(
        endpoints=[
            Endpoint(role="prefill", url=prefill_url, kv_key="k1"),
            Endpoint(role="decode", url=decode_url, kv_key="k2"),
        ]
    )
    for i in range(3):
        response = httpx.post(
            router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": f"w{i}"}, timeout=30
        )
        assert response.status_code == 200
        assert response.json() == decode.completion(f"w{i}", "done")
    assert prefill.posts() == []
    assert [r.body for r in decode.posts()] == [BODY] * 3  # whole requests, no kv_transfer_params
    _wait_metric(router.url, 'baton_router_fallbacks_total{reason="no_paired_prefill"}', 3.0)


def test_decode_pods_of_the_key_gone_between_the_legs(start_engine, start_router) -> None:
    """The prefill pod's key lost its last decode pod while the prefill ran: the lease is
    released and the request goes whole to a decode pod of the other key (no 503)."""
    gate = threading.Event()
    prefill, prefill_url = start_engine("p-old", prefill_gate=gate)
    old_decode, old_url = start_engine("d-old")
    new_decode, new_url = start_engine("d-new")
    old = Endpoint(role="decode", url=old_url, kv_key="k1")
    router = start_router(
        endpoints=[
            Endpoint(role="prefill", url=prefill_url, kv_key="k1"),
            old,
            Endpoint(role="decode", url=new_url, kv_key="k2"),
        ]
    )
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            httpx.post, router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "x1"}, timeout=30
        )
        wait_for(lambda: len(prefill.posts()) == 1, message="the prefill leg to arrive")
        router.discovery.remove(old.key)
        gate.set()
        response = sent.result()
    assert response.status_code == 200
    assert response.json() == new_decode.completion("x1", "done")
    assert old_decode.posts() == []
    assert [r.body for r in new_decode.posts()] == [BODY]
    wait_for(
        lambda: [r.path for r in prefill.posts()] == ["/v1/completions", contract.PATH_KV_TRANSFER_RELEASE],
        message="the lease released on the prefill pod",
    )
    assert prefill.posts()[1].body == {"kv_transfer_params": prefill.params_for("x1")}
    _wait_metric(router.url, 'baton_router_fallbacks_total{reason="no_paired_decode"}', 1.0)


def test_each_pod_is_scored_with_its_own_block_size() -> None:
    """Mid block-size rollout: the same prompt has other block keys on a 4-token pod than on an
    8-token pod; each pod's cached blocks are found with its own keys."""
    prompt = list(range(200, 224))  # 24 tokens: 6 blocks of 4, 3 blocks of 8
    keys4 = EventKeyHasher.named("fast", 4).block_hashes(prompt)
    keys8 = EventKeyHasher.named("fast", 8).block_hashes(prompt)
    assert block_hasher("none", 4) is None
    small = Endpoint(role="prefill", url="http://10.0.0.4:8000", block_size=4, prefix_hash="fast")
    large = Endpoint(role="prefill", url="http://10.0.0.8:8000", block_size=8, prefix_hash="fast")
    unhashed = Endpoint(role="prefill", url="http://10.0.0.9:8000", block_size=8, prefix_hash="none")
    index = DictIndex({"10.0.0.4": set(keys4[:5]), "10.0.0.8": set(keys8[:2]), "10.0.0.9": set(keys8)})
    scorer = PrefixScorer(index=index, hasher_factory=block_hasher)
    assert scorer.matched_blocks("completions", {"prompt": prompt}, [small, large, unhashed]) == {
        small.key: 5,
        large.key: 2,
    }
    # Without its own settings a pod is scored with the scorer's default hasher.
    plain = Endpoint(role="prefill", url="http://10.0.0.4:8000")
    defaulted = PrefixScorer(index=index, hasher=EventKeyHasher.named("fast", 4), hasher_factory=block_hasher)
    assert defaulted.matched_blocks("completions", {"prompt": prompt}, [plain]) == {plain.key: 5}


def test_each_pod_is_scored_with_its_own_hash_seed() -> None:
    """Mid rollout of a new prefixHashSeed: vLLM-style keys of the two seeds differ, and each
    pod is matched with its own."""
    prompt = list(range(300, 316))  # 2 blocks of 8
    keys0 = block_hasher("vllm-sha256", 8, "0").block_hashes(prompt)  # type: ignore[union-attr]
    keys1 = block_hasher("vllm-sha256", 8, "1").block_hashes(prompt)  # type: ignore[union-attr]
    assert keys0 != keys1
    old = Endpoint(
        role="prefill",
        url="http://10.0.1.1:8000",
        block_size=8,
        prefix_hash="vllm-sha256",
        prefix_hash_seed="0",
    )
    new = Endpoint(
        role="prefill",
        url="http://10.0.1.2:8000",
        block_size=8,
        prefix_hash="vllm-sha256",
        prefix_hash_seed="1",
    )
    index = DictIndex({"10.0.1.1": set(keys0), "10.0.1.2": set(keys1[:1])})
    scorer = PrefixScorer(index=index, hasher_factory=block_hasher)
    assert scorer.matched_blocks("completions", {"prompt": prompt}, [old, new]) == {old.key: 2, new.key: 1}
