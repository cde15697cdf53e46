"""Scale to zero and back end to end on the local control plane: real engines (SmolLM2 on CPU)
on a process node, the router (which stays up), the operator as a process.

1. No request: after scaleToZeroIdleSeconds both pools are at zero pods; status and Events say
   "scaled to zero (idle N s)", Ready is True (ScaledToZero).
2. One request: the router holds it, the autoscaler sees it within a second and wakes both pools
   ("woken by 1 waiting request") past a scale-up window longer than the hold timeout would
   allow, and the request is answered: the cold start, measured and printed as one JSON line.
3. Idle again, then a burst beyond the router's hold queue: exactly the queue's worth is held
   and answered, the rest get 503 with Retry-After at once; no accepted request is lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton_dev.demo_manifests import PROCESS_NODES, with_node_selector
from baton_dev.testing import DevCluster, condition, is_ready, wait_for
from baton_engine import contract
from baton_operator import models
from baton_support.operator_process import OperatorProcess, operator_process
from tests.rollout_e2e.engines import http_url

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
NAME = "zero"
IDLE_S = 15
HOLD_QUEUE = 3
POD = {"resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, "startupTimeoutSeconds": 600}
SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    "mode": "disaggregated",
    "engine": {"device": "cpu", "dtype": "float32", "maxModelLen": 512, "numKvBlocks": 64},
    "prefill": POD,
    "decode": POD,
    "router": {"replicas": 1, "holdQueue": HOLD_QUEUE, "holdTimeoutSeconds": 600},
    "autoscaling": {
        "mode": "builtin",
        "intervalSeconds": 2,
        "scaleToZeroIdleSeconds": IDLE_S,
        "prefill": {"minReplicas": 0, "maxReplicas": 1},
        "decode": {"minReplicas": 0, "maxReplicas": 1},
        # Waking must not wait for this (a request would be held that long).
        "scaleUp": {"stabilizationWindowSeconds": 900, "maxStep": 1},
        "scaleDown": {"stabilizationWindowSeconds": 0, "maxStep": 1},
    },
}
BODY = {"model": "smollm2", "prompt": "Say hello in French.", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def operator(dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    dev_cluster.kubectl("apply", "-f", str(REPO / "crds"))
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencedeployments.baton.dev"

    def established() -> bool:
        conditions = dev_cluster.admin.get(crd).get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for("the CRD to be Established", established, timeout_s=60)
    with operator_process(
        dev_cluster.state.admin_kubeconfig, tmp_path_factory.mktemp("operator"), "--no-peering"
    ) as proc:
        yield proc


class Deployment:
    def __init__(self, cluster: DevCluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        self.path = f"/apis/{models.API_VERSION}/namespaces/{ns}/{models.PLURAL}/{NAME}"

    def pods(self, role: str) -> list[dict[str, Any]]:
        return self.cluster.pods(self.ns, f"{contract.LABEL_DEPLOYMENT}={NAME},{contract.LABEL_ROLE}={role}")

    def replicas(self, role: str) -> int:
        d = self.cluster.admin.get(f"/apis/apps/v1/namespaces/{self.ns}/deployments/{NAME}-{role}")
        return int(d["spec"].get("replicas", 1))

    def at_zero(self) -> bool:
        return all(self.replicas(r) == 0 and not self.pods(r) for r in ("prefill", "decode"))

    def events(self, reason: str) -> list[str]:
        items = self.cluster.admin.get(f"/api/v1/namespaces/{self.ns}/events")["items"]
        return sorted(
            e["message"] for e in items if e["reason"] == reason and e["involvedObject"]["name"] == NAME
        )

    def get(self) -> dict[str, Any]:
        return self.cluster.admin.get(self.path)


def post(url: str) -> httpx.Response:
    return httpx.post(url, json=BODY, timeout=900, trust_env=False)


def test_idle_to_zero_a_request_wakes_both_pools_and_a_burst_beyond_the_queue_gets_503(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    ns = k8s_namespace
    doc = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": NAME}, "spec": SPEC}
    dev_cluster.apply(with_node_selector(doc, PROCESS_NODES), ns)
    res = Deployment(dev_cluster, ns)

    def router_ready() -> dict[str, Any] | None:
        found = res.pods("router")
        return found[0] if len(found) == 1 and is_ready(found[0]) else None

    router = wait_for("the router Ready", router_ready, timeout_s=600, interval_s=1)
    url = http_url(router, "/v1/completions")

    # 1. Idle: both pools to zero, the router stays up.
    wait_for("both pools at zero pods", res.at_zero, timeout_s=900, interval_s=1)
    scaled = f"scaled to zero (idle {IDLE_S} s)"
    wait_for(
        "the ScaledDown Events", lambda: len(res.events("ScaledDown")) >= 2, timeout_s=60, interval_s=0.5
    )
    assert res.events("ScaledDown")[-2:] == [
        f"decode: scale down 1 -> 0: {scaled}",
        f"prefill: scale down 1 -> 0: {scaled}",
    ]
    infd = res.get()
    assert scaled in infd["status"]["autoscaling"]["reason"]
    ready = condition(infd, "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    assert is_ready(dev_cluster.pod(ns, router["metadata"]["name"]))

    # 2. One request wakes both pools; it is held until they serve it.
    with ThreadPoolExecutor(1) as pool:
        sent = time.monotonic()
        answer = pool.submit(post, url)
        woke = wait_for(
            "the wake-up Events",
            lambda: len([m for m in res.events("ScaledUp") if "woken by 1 waiting request" in m]) == 2,
            timeout_s=60,
            interval_s=0.2,
        )
        woken_after = time.monotonic() - sent
        response = answer.result()
    cold_start = time.monotonic() - sent
    assert woke and response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert sorted(m for m in res.events("ScaledUp") if "woken" in m) == [
        "decode: scale up 0 -> 1: woken by 1 waiting request",
        "prefill: scale up 0 -> 1: woken by 1 waiting request",
    ]
    print(json.dumps({"cold_start_s": round(cold_start, 2), "woken_after_s": round(woken_after, 2)}))

    # 3. Idle again, then a burst of twice the hold queue.
    wait_for("both pools at zero pods again", res.at_zero, timeout_s=300, interval_s=1)
    with ThreadPoolExecutor(2 * HOLD_QUEUE) as pool:
        answers = list(pool.map(lambda _: post(url), range(2 * HOLD_QUEUE)))
    refused = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    assert (len(served), len(refused)) == (HOLD_QUEUE, HOLD_QUEUE), [a.status_code for a in answers]
    for a in refused:
        assert a.headers["retry-after"] == "5"
        assert a.json()["error"]["message"] == (
            f"no decode pod available and {HOLD_QUEUE} requests already wait for one "
            f"(the router holds at most {HOLD_QUEUE})"
        )
    assert all(a.json()["choices"][0]["text"] for a in served)
