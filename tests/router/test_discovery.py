"""Pods -> endpoints (the Kubernetes watch itself is tested with the local control plane)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from baton_engine import contract
from baton_engine.router.discovery import (
    RolePods,
    endpoint_from_pod,
    named_ports,
    selector_string,
    static_endpoints,
)
from baton_engine.router.endpoints import Endpoint, EndpointRegistry

POD: dict[str, Any] = {
    "metadata": {"name": "demo-prefill-abc", "uid": "uid-1", "labels": {"baton.dev/role": "prefill"}},
    "spec": {
        "containers": [
            {
                "name": "engine",
                "ports": [
                    {"name": "http", "containerPort": 8001},
                    {"name": "kv-events", "containerPort": 6001},
                    {"name": "kv-transfer", "containerPort": 6100},
                    {"containerPort": 9999},
                ],
            },
            {
                "name": "sidecar",
                "ports": [{"name": "http", "containerPort": 1}, {"name": "metrics", "containerPort": 9100}],
            },
        ]
    },
    "status": {
        "podIP": "10.1.2.3",
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
    },
}


def _pod(**edits: Any) -> dict[str, Any]:
    pod = copy.deepcopy(POD)
    for path, value in edits.items():
        *parents, leaf = path.split("__")
        node = pod
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return pod


def test_ready_pod_becomes_an_endpoint_with_named_ports() -> None:
    endpoint = endpoint_from_pod(POD, contract.ROLE_PREFILL)
    assert endpoint == Endpoint(
        role="prefill", url="http://10.1.2.3:8001", name="demo-prefill-abc", uid="uid-1"
    )
    assert dict(endpoint.ports) == {"http": 8001, "kv-events": 6001, "kv-transfer": 6100, "metrics": 9100}
    assert endpoint.port(contract.PORT_KV_EVENTS) == 6001
    assert endpoint.port(contract.PORT_KV_EVENTS_REPLAY) == contract.DEFAULT_KV_EVENTS_REPLAY_PORT
    assert {"10.1.2.3", "10.1.2.3:8001", "10.1.2.3:6001", "demo-prefill-abc", "uid-1"} <= endpoint.aliases()


@pytest.mark.parametrize(
    "edits",
    [
        {"status__conditions": [{"type": "Ready", "status": "False"}]},
        {"status__conditions": [{"type": "PodScheduled", "status": "True"}]},
        {"status__conditions": None},
        {"status__podIP": None},
        {"status__podIP": ""},
        {"metadata__deletionTimestamp": "2026-11-30T03:00:00Z"},
    ],
)
def test_pods_that_must_not_get_traffic(edits: dict[str, Any]) -> None:
    assert endpoint_from_pod(_pod(**edits), contract.ROLE_PREFILL) is None


def test_default_http_port_and_ipv6() -> None:
    pod = _pod(spec__containers=[{"name": "engine"}], status__podIP="fd00::7")
    endpoint = endpoint_from_pod(pod, contract.ROLE_DECODE)
    assert endpoint is not None
    assert endpoint.url == f"http://[fd00::7]:{contract.DEFAULT_HTTP_PORT}"
    assert endpoint.host == "fd00::7"
    assert named_ports(pod) == {}


def test_restart_replaces_the_endpoint_and_emits_events() -> None:
    registry = EndpointRegistry()
    events: list[tuple[str, str]] = []
    registry.subscribe(lambda kind, e: events.append((kind, f"{e.uid}@{e.host}")))
    first = endpoint_from_pod(POD, "prefill")
    assert first is not None
    owned = registry.replace_source(set(), [first])
    owned = registry.replace_source(owned, [first])  # unchanged pod: no event
    restarted = endpoint_from_pod(_pod(metadata__uid="uid-2", status__podIP="10.1.2.9"), "prefill")
    assert restarted is not None
    owned = registry.replace_source(owned, [restarted])
    registry.replace_source(owned, [])
    assert events == [
        ("added", "uid-1@10.1.2.3"),
        ("removed", "uid-1@10.1.2.3"),
        ("added", "uid-2@10.1.2.9"),
        ("removed", "uid-2@10.1.2.9"),
    ]


def test_watch_events_drive_the_registry() -> None:
    """The watch loop's bookkeeping: list, then ADDED/MODIFIED/DELETED/BOOKMARK events."""
    registry = EndpointRegistry()
    events: list[str] = []
    registry.subscribe(lambda kind, e: events.append(f"{kind} {e.name}@{e.host}"))
    pods = RolePods(
        "prefill", [POD, _pod(metadata__uid="uid-2", metadata__name="p2", status__podIP="10.1.2.4")]
    )
    owned = registry.replace_source(set(), pods.endpoints())
    not_ready = _pod(status__conditions=[{"type": "Ready", "status": "False"}])
    steps = [
        ("BOOKMARK", {"metadata": {"resourceVersion": "9"}}),
        ("MODIFIED", not_ready),  # POD stops being ready
        ("MODIFIED", POD),  # and is ready again
        ("DELETED", _pod(metadata__uid="uid-2", metadata__name="p2", status__podIP="10.1.2.4")),
        ("ADDED", _pod(metadata__uid="uid-3", metadata__name="p3", status__podIP="10.1.2.5")),
    ]
    changed = []
    for kind, pod in steps:
        changed.append(pods.apply(kind, pod))
        owned = registry.replace_source(owned, pods.endpoints())
    assert changed == [False, True, True, True, True]
    assert events == [
        "added demo-prefill-abc@10.1.2.3",
        "added p2@10.1.2.4",
        "removed demo-prefill-abc@10.1.2.3",
        "added demo-prefill-abc@10.1.2.3",
        "removed p2@10.1.2.4",
        "added p3@10.1.2.5",
    ]
    assert sorted(e.name for e in registry.by_role("prefill")) == ["demo-prefill-abc", "p3"]


def test_subscribe_replays_current_endpoints() -> None:
    registry = EndpointRegistry()
    registry.upsert(Endpoint(role="decode", url="http://127.0.0.1:1"))
    seen: list[str] = []
    registry.subscribe(lambda kind, e: seen.append(f"{kind} {e.url}"))
    assert seen == ["added http://127.0.0.1:1"]


def test_static_endpoints() -> None:
    endpoints = static_endpoints(
        {"prefill": ["127.0.0.1:8001", "http://127.0.0.2:8001/"], "decode": ["http://h:9"]}
    )
    assert [(e.role, e.url, e.name) for e in endpoints] == [
        ("prefill", "http://127.0.0.1:8001", "http://127.0.0.1:8001"),
        ("prefill", "http://127.0.0.2:8001", "http://127.0.0.2:8001"),
        ("decode", "http://h:9", "http://h:9"),
    ]
    one_host = static_endpoints(
        {"prefill": ["127.0.0.1:8001#kv-events=5601,kv-replay=5602", "127.0.0.1:8002"]},
        ports={"kv-events": 5557, "kv-replay": 5558},
    )
    assert [(e.url, e.port("kv-events"), e.port("kv-replay")) for e in one_host] == [
        ("http://127.0.0.1:8001", 5601, 5602),
        ("http://127.0.0.1:8002", 5557, 5558),
    ]
    with pytest.raises(ValueError, match="endpoint http://h:1: port 'kv-events=x' is not NAME=PORT"):
        static_endpoints({"prefill": ["h:1#kv-events=x"]})
    with pytest.raises(ValueError, match="prefill endpoints: http://127.0.0.1:8001 given twice"):
        static_endpoints({"prefill": ["127.0.0.1:8001", "http://127.0.0.1:8001"]})
    with pytest.raises(ValueError, match="endpoint url: 'ftp://x' is not an http"):
        static_endpoints({"decode": ["ftp://x"]})
    with pytest.raises(ValueError, match="endpoint role: 'router' is not one of"):
        Endpoint(role="router", url="http://x:1")


def test_selector_string() -> None:
    assert (
        selector_string(contract.pod_selector("demo", "decode"))
        == "baton.dev/deployment=demo,baton.dev/role=decode"
    )
