"""A KV-compatibility key rollout end to end on the local control plane: real engines (SmolLM2
on CPU) on a process node behind the router, the operator as a process, steady load through the
router the whole time.

1. The block size changes (a new key): the pools roll decode first in two generations.
2. A plain env var changes (no new key): each pool rolls in place.

Checked: every client request succeeds; no transfer between keys (no engine ever counted a
kv_key_mismatch, by metrics sampled from every engine pod while it lived and by every engine
pod's log) while transfers went on in both generations; every pod state the API server went
through keeps each pool within one pod of its spec and no generation with prefill pods but no
decode pod; the old prefill pods drained their leases before they stopped.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from baton_dev.demo_manifests import PROCESS_NODES, with_node_selector
from baton_dev.kubeapi import ApiAccess
from baton_dev.testing import DevCluster, is_ready, wait_for
from baton_engine import contract
from baton_operator import models
from baton_support.operator_process import OperatorProcess, cluster_operator
from bench.cold_start import http_url
from tests.autoscaler_e2e.load import LoadGenerator
from tests.operator_tests.timeline import (
    Timeline,
    key_of,
    key_of_pod,
    role_of,
    rollout_invariants,
    rollout_settled,
)
from tests.rollout_e2e.engines import EngineSampler

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(2400)]

NAME = "roll"
COUNTS = {"prefill": 1, "decode": 1}
POD = {"resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, "startupTimeoutSeconds": 600,
       "terminationGracePeriodSeconds": 60}  # fmt: skip
SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    "mode": "disaggregated",
    "engine": {
        "device": "cpu",
        "dtype": "float32",
        "blockSize": 16,
        "maxModelLen": 512,
        "maxNumSeqs": 8,
        "maxNumBatchedTokens": 256,
        "numKvBlocks": 128,
    },
    "prefill": {"replicas": 1, **POD},
    "decode": {"replicas": 1, **POD},
    "router": {"replicas": 1, "resources": {"cpu": "250m", "memory": "512Mi"}},
    "kvTransfer": {"leaseSeconds": 60},
    "autoscaling": {"mode": "off"},
}
# ~48 prompt tokens: three blocks of 16 (one and a half of 32) move from prefill to decode.
BODY = {
    "model": "smollm2",
    "prompt": "List the planets of the solar system in order from the sun, with one fact about each:",
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def operator(dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with cluster_operator(dev_cluster, tmp_path_factory.mktemp("operator"), "--no-peering") as proc:
        yield proc


def pods(cluster: DevCluster, ns: str, role: str) -> list[dict[str, Any]]:
    return cluster.pods(ns, f"{contract.LABEL_DEPLOYMENT}={NAME},{contract.LABEL_ROLE}={role}")


def settled(cluster: DevCluster, ns: str, key: str, check: Any = None) -> bool:
    """One Ready pod per pool, all of `key` (and passing `check`), no old generation, Stable."""
    return rollout_settled(cluster, ns, NAME, key, COUNTS, check)


def has_env(pod: dict[str, Any]) -> bool:
    return any(e["name"] == "PLAIN_CHANGE" for e in pod["spec"]["containers"][0].get("env") or [])


def test_key_change_then_plain_change_under_load(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    ns = k8s_namespace
    doc = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": NAME}, "spec": SPEC}
    dev_cluster.apply(with_node_selector(doc, PROCESS_NODES), ns)
    old_key = key_of(SPEC)
    wait_for(
        lambda: settled(dev_cluster, ns, old_key),
        timeout=900,
        interval=1,
        message="the first generation Ready",
    )

    def router_ready() -> dict[str, Any] | None:
        found = pods(dev_cluster, ns, "router")
        return found[0] if len(found) == 1 and is_ready(found[0]) else None

    router = wait_for(router_ready, timeout=300, interval=1, message="the router Ready")
    path = f"/apis/{models.API_VERSION}/namespaces/{ns}/{models.PLURAL}/{NAME}"
    changed = copy.deepcopy(SPEC)
    changed["engine"]["blockSize"] = 32
    new_key = key_of(changed)
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    seen_pods: set[str] = set()

    load = LoadGenerator(http_url(router, "/v1/completions"), BODY, timeout_s=300).start(concurrency=2)
    try:
        with EngineSampler(dev_cluster, ns, NAME) as sampler:
            wait_for(
                lambda: load.snapshot()[0] >= 5,
                timeout=300,
                interval=0.5,
                message="requests served before the rollout",
            )

            def roll(change: dict[str, Any], check: Any, what: str) -> Timeline:
                """Apply a spec change; every pod state until it has rolled out and served 5 more."""
                with Timeline(access, f"/api/v1/namespaces/{ns}/pods") as states:
                    dev_cluster.admin.patch(path, {"spec": change})
                    wait_for(
                        lambda: settled(dev_cluster, ns, new_key, check),
                        timeout=1200,
                        interval=1,
                        message=f"{what} rolled out",
                    )
                    served = load.snapshot()[0]
                    wait_for(
                        lambda: load.snapshot()[0] >= served + 5,
                        timeout=300,
                        interval=0.5,
                        message=f"requests served after {what}",
                    )
                return states

            key_change = roll({"engine": {"blockSize": 32}}, None, "the key change")
            plain_change = roll(
                {"engine": {"env": [{"name": "PLAIN_CHANGE", "value": "1"}]}}, has_env, "the plain change"
            )
    finally:
        stats = load.stop()

    assert stats.failures == [], f"{len(stats.failures)} failed requests, first: {stats.failures[:3]}"
    assert stats.ok >= 15

    # The pods' states, as the API server went through them.
    rollout_invariants(key_change, COUNTS, new_key)
    plain_states = list(plain_change.states())
    assert {key_of_pod(p) for s in plain_states for p in s.values() if role_of(p) in COUNTS} == {new_key}
    for state in plain_states:  # rolled in place: each pool maxSurge 1, maxUnavailable 0
        for role, n in COUNTS.items():
            live = [
                p for p in state.values() if role_of(p) == role and not p["metadata"].get("deletionTimestamp")
            ]
            assert len(live) <= n + 1
    for timeline in (key_change, plain_change):
        seen_pods |= {p["metadata"]["name"] for p in timeline.ever() if role_of(p) in COUNTS}

    # No transfer between keys, while transfers went on in each generation.
    mismatches = sampler.total(contract.M_KV_TRANSFER_FAILURES, reason="kv_key_mismatch")
    assert mismatches and set(mismatches.values()) == {0.0}, mismatches
    received = sampler.total(contract.M_KV_TRANSFER_BYTES, direction="received")
    by_key: dict[str, float] = {}
    for pod, value in received.items():
        if sampler.roles[pod] == contract.ROLE_DECODE:
            by_key[sampler.keys[pod]] = by_key.get(sampler.keys[pod], 0.0) + value
    assert by_key.get(old_key, 0) > 0 and by_key.get(new_key, 0) > 0, by_key
    for pod in seen_pods:
        log = dev_cluster.pod_log(ns, pod, "engine")
        assert "kv_key_mismatch" not in log, pod
    # The old generation's prefill pods stopped once their leases were pulled, not at the deadline.
    old_prefill = [
        p["metadata"]["name"]
        for p in key_change.ever()
        if role_of(p) == contract.ROLE_PREFILL and key_of_pod(p) == old_key
    ]
    assert old_prefill
    for pod in set(old_prefill):
        assert "drained; stopping" in dev_cluster.pod_log(ns, pod, "engine"), pod
