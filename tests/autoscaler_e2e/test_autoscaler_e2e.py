"""The built-in autoscaler end to end on the local control plane: real engines (SmolLM2 on CPU)
on a process node behind the router, the operator as a process, a load generator.

1. Long prompts, 4 tokens each: the prefill queue grows. The first decision that saw it above
   the target raises prefill from 1 to 2 (from the recorded decisions: status history and the
   status snapshots), and the new prefill pod serves traffic.
2. The same prompts, 96 tokens each: decode's small KV cache (spec.decode.engine.numKvBlocks)
   stays full, decode grows.
3. Heavy load stops (a light load keeps running): both pools return to 1 after the window, the
   removed pods drain the requests they still run.
Every client request during all of this succeeds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from baton_dev.demo_manifests import PROCESS_NODES, with_node_selector
from baton_dev.kubeapi import ApiAccess
from baton_dev.testing import DevCluster, is_ready
from baton_engine import contract
from baton_operator import models
from baton_support.operator_process import OperatorProcess, cluster_operator
from baton_support.wait import wait_for
from tests.autoscaler_e2e.load import LoadGenerator
from tests.operator_tests.timeline import Timeline

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model]

NAME = "scale"
TARGET_QUEUE = 1
TARGET_KV = 0.5
WINDOW_S = 20
INTERVAL_S = 2
# ~110 tokens (7 KV blocks): decode holds several at once, so prefill stays the bottleneck.
PROMPT = "Here is a list of facts about the planets of the solar system, one per line. " * 7
PREFILL_HEAVY = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
DECODE_HEAVY = {  # ~7 blocks of prompt growing to ~17: three such requests fill decode's 40 blocks
    "model": "smollm2",
    "prompt": PROMPT,
    "max_tokens": 96,
    "temperature": 0,
    "ignore_eos": True,
}
LIGHT = {"model": "smollm2", "prompt": "Say hello.", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    "mode": "disaggregated",
    "engine": {
        "device": "cpu",
        "dtype": "float32",
        "maxModelLen": 512,
        "maxNumSeqs": 8,
        "maxNumBatchedTokens": 256,
        "numKvBlocks": 256,
    },
    "prefill": {
        "engine": {"maxNumSeqs": 1, "maxNumBatchedTokens": 32},  # 4 steps per prompt
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
        "startupTimeoutSeconds": 300,
        "terminationGracePeriodSeconds": 30,
    },
    "decode": {
        "engine": {"numKvBlocks": 40},  # 640 tokens: a few requests fill it
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
        "startupTimeoutSeconds": 300,
        "terminationGracePeriodSeconds": 30,
    },
    "router": {"replicas": 1, "resources": {"cpu": "250m", "memory": "512Mi"}},
    "autoscaling": {
        "mode": "builtin",
        "intervalSeconds": INTERVAL_S,
        "prefill": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": TARGET_QUEUE},
        "decode": {"minReplicas": 1, "maxReplicas": 2, "targetKVUsage": TARGET_KV},
        "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 1},
        "scaleDown": {"stabilizationWindowSeconds": WINDOW_S, "maxStep": 1},
    },
}


@dataclass
class Decisions:
    """Every decision written to the resource: status snapshots and history rows."""

    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)  # decision time -> status.autoscaling
    recommendations: set[tuple[float, str, int]] = field(default_factory=set)
    actions: set[tuple[float, str, int, int]] = field(default_factory=set)


def decisions_in(versions: list[dict[str, Any]]) -> Decisions:
    """The decisions in every version of the resource a watch saw (a watch delivers each version
    in order, so none is missed however slowly the test ran; polling could skip the one
    decision a test looks for)."""
    found = Decisions()
    for obj in versions:
        auto = (obj.get("status") or {}).get("autoscaling") or {}
        if not auto.get("time"):
            continue
        found.snapshots.setdefault(auto["time"], auto)
        history = json.loads(auto.get("history") or "{}")
        found.recommendations.update((r[0], r[1], r[2]) for r in history.get("recommendations", []))
        found.actions.update((a[0], a[1], a[2], a[3]) for a in history.get("actions", []))
    return found


@pytest.fixture
def operator(dev_cluster: DevCluster, k8s_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    with cluster_operator(
        dev_cluster, tmp_path, "--no-peering", "--resync-seconds=5", namespace=k8s_namespace
    ) as proc:
        yield proc


def _replicas(cluster: DevCluster, ns: str, role: str) -> int:
    d = cluster.admin.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}-{role}")
    return int(d["spec"].get("replicas", 1))


def _pods(cluster: DevCluster, ns: str, role: str) -> list[dict[str, Any]]:
    return cluster.pods(ns, f"{contract.LABEL_DEPLOYMENT}={NAME},{contract.LABEL_ROLE}={role}")


def _url(pod: dict[str, Any], path: str) -> str:
    port = next(
        p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"] if p["name"] == "http"
    )
    return f"http://{pod['status']['podIP']}:{port}{path}"


def _served(pod: dict[str, Any]) -> float:
    text = httpx.get(_url(pod, "/metrics"), timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(contract.M_REQUEST_SUCCESS.removesuffix("_total"))
        and not line.startswith("#")
        and "_created" not in line
    )


def test_prefill_and_decode_scale_with_load_and_back(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    ns = k8s_namespace
    doc = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": NAME}, "spec": SPEC}
    dev_cluster.apply(with_node_selector(doc, PROCESS_NODES), ns)

    def all_ready() -> bool:
        roles = [contract.ROLE_PREFILL, contract.ROLE_DECODE, contract.ROLE_ROUTER]
        return all(len(p := _pods(dev_cluster, ns, r)) == 1 and is_ready(p[0]) for r in roles)

    wait_for(all_ready, timeout=600, interval=1, message="one Ready prefill, decode and router pod")
    (router,) = _pods(dev_cluster, ns, contract.ROLE_ROUTER)
    (first_prefill,) = _pods(dev_cluster, ns, contract.ROLE_PREFILL)
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    path = f"/apis/{models.API_VERSION}/namespaces/{ns}/{models.PLURAL}"
    url = _url(router, "/v1/completions")
    with Timeline(access, path, fieldSelector=f"metadata.name={NAME}") as versions:
        load = LoadGenerator(url, PREFILL_HEAVY, timeout_s=300).start(concurrency=10)
        try:
            # 1. Prefill grows, and the new pod serves.
            wait_for(
                lambda: _replicas(dev_cluster, ns, "prefill") >= 2,
                timeout=240,
                interval=0.5,
                message="prefill scaled to 2",
            )

            def new_prefill() -> dict[str, Any] | None:
                pods = [
                    p
                    for p in _pods(dev_cluster, ns, "prefill")
                    if p["metadata"]["uid"] != first_prefill["metadata"]["uid"]
                ]
                return pods[0] if pods and is_ready(pods[0]) else None

            added = wait_for(new_prefill, timeout=300, interval=1, message="the new prefill pod Ready")
            wait_for(
                lambda: _served(added) > 0,
                timeout=120,
                interval=1,
                message="the new prefill pod to serve requests",
            )

            # 2. Decode grows on KV pressure.
            load.set_body(DECODE_HEAVY)
            load.set_concurrency(6)
            wait_for(
                lambda: _replicas(dev_cluster, ns, "decode") >= 2,
                timeout=240,
                interval=0.5,
                message="decode scaled to 2",
            )

            # 3. Heavy load stops; a light load keeps requests in flight while pods are removed.
            load.set_body(LIGHT)
            load.set_concurrency(1)
            for role in ("prefill", "decode"):
                wait_for(
                    lambda r=role: _replicas(dev_cluster, ns, r) == 1,
                    timeout=240,
                    interval=0.5,
                    message=f"{role} back to 1",
                )
            for role in ("prefill", "decode"):
                wait_for(
                    lambda r=role: len(_pods(dev_cluster, ns, r)) == 1,
                    timeout=120,
                    interval=0.5,
                    message=f"one {role} pod left",
                )
        finally:
            stats = load.stop()

    assert stats.failures == [], f"{len(stats.failures)} failed requests, first: {stats.failures[:3]}"
    assert stats.ok > 20

    # The first decision that saw prefill's queue above its target raised prefill 1 -> 2.
    recorded = decisions_in(versions.ever())
    decisions = sorted(recorded.snapshots.values(), key=lambda a: a["time"])
    crossing = next(a for a in decisions if a["metrics"].get("prefill.waitingRequests", 0) > TARGET_QUEUE)
    assert crossing["currentReplicas"]["prefill"] == 1, crossing
    assert crossing["lastDecision"]["prefill"] == 2, crossing
    assert crossing["scrapedAt"] <= crossing["time"]
    prefill_recs = sorted(r for r in recorded.recommendations if r[1] == "prefill")
    first_high = next(r for r in prefill_recs if r[2] > 1)
    prefill_ups = sorted(a for a in recorded.actions if a[1] == "prefill" and a[3] > a[2])
    assert prefill_ups[0][0] == first_high[0] and prefill_ups[0][2:] == (1, 2)
    # Decode grew because its KV cache was over the target.
    decode_up = next(a for a in decisions if a["lastDecision"]["decode"] > a["currentReplicas"]["decode"])
    assert decode_up["metrics"]["decode.kvUsage"] > TARGET_KV, decode_up

    # Down again: ScaledDown events for both pools (Kopf posts them from a queue, after the
    # replicas and the status were written).
    def scaled_down(role: str) -> bool:
        events = dev_cluster.admin.get(f"/api/v1/namespaces/{ns}/events")["items"]
        downs = [e["message"] for e in events if e["reason"] == "ScaledDown"]
        return any(m.startswith(f"{role}: scale down 2 -> 1") for m in downs)

    for role in ("prefill", "decode"):
        wait_for(
            lambda r=role: scaled_down(r),
            timeout=60,
            interval=0.5,
            message=f"a ScaledDown event for {role} 2 -> 1",
        )
    print(yaml.safe_dump({"requests_ok": stats.ok, "statuses": dict(stats.by_status)}))
