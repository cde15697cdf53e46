"""The built-in autoscaler inside `baton-operator run` (the chart's ServiceAccount) on a real API
server. Engine pods are Pod objects whose status the test writes (no kubelet here) pointing at
real HTTP servers that answer /metrics with the load the test sets.

Covers: scale-up under baton-autoscaler's field manager, the operator's own reconciles not
reverting it, status.autoscaling, ScaledUp/ScaledDown Events, the scale-action metric, scale-down
one step per stabilization window, `external` mode never writing replicas, and a resize's Event
posted once even when the other pool's write is refused (by an admission policy)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from baton_engine import contract
from baton_operator.autoscaler.tick import FIELD_MANAGER as AUTOSCALER_MANAGER
from baton_operator.kube import FIELD_MANAGER, collection_path
from tests.operator_tests.apiserver import ApiServer
from tests.operator_tests.autoscaler.metrics_servers import MetricsServer, answer
from tests.operator_tests.kube_helpers import Rest, create_infd, create_namespace, get_infd, wait_for
from tests.operator_tests.operator_process import OperatorProcess, operator_process

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NS = "autoscale"
WINDOW_S = 3
SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    "autoscaling": {
        "mode": "builtin",
        "intervalSeconds": 1,
        "prefill": {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2},
        "decode": {"minReplicas": 1, "maxReplicas": 2, "targetKVUsage": 0.5},
        "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2},
        "scaleDown": {"stabilizationWindowSeconds": WINDOW_S, "maxStep": 1},
    },
}


class Load:
    """One engine's /metrics, settable by the test."""

    def __init__(self) -> None:
        self.waiting, self.kv = 0, 0.1
        self.server = MetricsServer(self._answer)

    def _answer(self, server: MetricsServer, handler: Any) -> None:
        text = (
            f'{contract.M_REQUESTS_WAITING}{{model_name="smollm2"}} {self.waiting}\n'
            f'{contract.M_REQUESTS_RUNNING}{{model_name="smollm2"}} 0\n'
            f'{contract.M_KV_USAGE}{{model_name="smollm2"}} {self.kv}\n'
        )
        answer(200, text)(server, handler)

    @property
    def port(self) -> int:
        return int(self.server.httpd.server_address[1])


@pytest.fixture(scope="module")
def operator(own_apiserver: ApiServer, own_kube: Any, chart_installed: Any) -> Iterator[OperatorProcess]:
    kubeconfig, _ = chart_installed
    create_namespace(own_kube, NS)
    with operator_process(kubeconfig, own_apiserver.workdir, "--resync-seconds=1") as proc:
        yield proc


@pytest.fixture
def loads() -> Iterator[dict[str, Load]]:
    made = {"prefill": Load(), "decode": Load()}
    yield made
    for load in made.values():
        load.server.stop()


def deployment_path(name: str) -> str:
    return collection_path("apps/v1", "Deployment", NS) + f"/{name}"


def add_ready_pod(rest: Rest, deployment: str, role: str, port: int) -> None:
    """A Running, Ready engine pod as a kubelet would report it, serving /metrics on `port`."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{deployment}-{role}-0",
            "labels": contract.pod_selector(deployment, role),
        },
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "baton",
                    "ports": [{"name": contract.PORT_HTTP, "containerPort": port}],
                }
            ]
        },
    }
    status, body = rest.call("POST", collection_path("v1", "Pod", NS), pod)
    assert status == 201, body
    ready = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
        }
    }
    path = collection_path("v1", "Pod", NS) + f"/{pod['metadata']['name']}/status"
    status, body = rest.call("PATCH", path, ready, "application/merge-patch+json")
    assert status == 200, body


def replicas(rest: Rest, name: str) -> int:
    return int(rest.get(deployment_path(name))["spec"]["replicas"])


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_builtin_scales_up_then_down_one_step_per_window(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    rest = Rest(own_apiserver)
    kube = own_kube
    create_infd(kube, NS, "grow", SPEC)
    wait_for(lambda: rest.call("GET", deployment_path("grow-decode"))[0] == 200, 30, "the role Deployments")
    for role, load in loads.items():
        add_ready_pod(rest, "grow", role, load.port)

    # Idle: the autoscaler decides "hold" and says so in status.
    def held() -> dict[str, Any] | None:
        auto = get_infd(kube, NS, "grow").get("status", {}).get("autoscaling") or {}
        return auto if auto.get("action") == "hold" and auto.get("scrapedAt") else None

    status = wait_for(held, 30, "a first 'hold' decision in status.autoscaling")
    assert status["lastDecision"] == {"prefill": 1, "decode": 1}
    assert status["currentReplicas"] == {"prefill": 1, "decode": 1}

    # A tick writes the replicas, then status.autoscaling, then posts its Events (Kopf sends
    # those from a queue) and counts the action: each is waited for on its own.
    def decided(prefill: int) -> dict[str, Any] | None:
        auto = get_infd(kube, NS, "grow")["status"]["autoscaling"]
        return auto if auto["lastDecision"]["prefill"] == prefill else None

    loads["prefill"].waiting = 6  # 6 waiting / target 2 -> 3 prefill pods
    wait_for(lambda: replicas(rest, "grow-prefill") == 3, 30, "prefill scaled to 3")
    deployment = rest.get(deployment_path("grow-prefill"))
    owners = {
        m["manager"]: json.dumps(m.get("fieldsV1", {})) for m in deployment["metadata"]["managedFields"]
    }
    assert '"f:replicas"' in owners[AUTOSCALER_MANAGER]
    assert '"f:replicas"' not in owners[FIELD_MANAGER]
    auto = wait_for(lambda: decided(3), 30, "status.autoscaling to record the scale-up to 3")
    assert auto["metrics"]["prefill.waitingRequests"] == 6.0
    assert "scale up 1 -> 3" in auto["reason"]

    # The operator's own reconciles (every second) leave the autoscaler's replicas alone.
    pattern = r'baton_operator_reconciles_total\{result="ok",trigger="timer"\} (\S+)'

    def timer_reconciles() -> float:
        found = re.search(pattern, operator.metrics())
        return float(found.group(1)) if found else 0.0

    start = timer_reconciles()
    wait_for(lambda: timer_reconciles() >= start + 3, 30, "three more timer reconciles")
    assert replicas(rest, "grow-prefill") == 3

    # Load stops: one step down per window, to the minimum.
    loads["prefill"].waiting = 0
    wait_for(lambda: replicas(rest, "grow-prefill") == 1, 60, "prefill back to 1")
    assert replicas(rest, "grow-decode") == 1

    def prefill_steps() -> list[tuple[str, str, str]]:
        events = rest.get(f"/api/v1/namespaces/{NS}/events")["items"]
        scaled = sorted(
            (
                e
                for e in events
                if e["involvedObject"]["name"] == "grow" and e["reason"] in ("ScaledUp", "ScaledDown")
            ),
            key=lambda e: e["metadata"]["creationTimestamp"] + e["metadata"]["name"],
        )
        steps = [re.search(r"prefill: scale (up|down) (\d+) -> (\d+)", e["message"]) for e in scaled]
        return [(m.group(1), m.group(2), m.group(3)) for m in steps if m]

    steps = wait_for(lambda: (s := prefill_steps()) and len(s) >= 3 and s, 30, "the scale-down Events")
    assert steps == [
        ("up", "1", "3"),
        ("down", "3", "2"),
        ("down", "2", "1"),
    ]
    # At most one scale-down per window: the status history keeps the last one's time.
    auto = wait_for(lambda: decided(1), 30, "status.autoscaling to record the scale-down to 1")
    last_down = [a for a in json.loads(auto["history"])["actions"] if a[1] == "prefill"]
    assert [a[2:] for a in last_down][-1:] == [[2, 1]]

    def actions() -> tuple[float, float]:
        text = operator.metrics()
        series = "baton_autoscaler_scale_actions_total"
        up = counter(text, series, deployment="grow", role="prefill", direction="up")
        down = counter(text, series, deployment="grow", role="prefill", direction="down")
        return up, down

    wait_for(lambda: actions() == (1.0, 2.0), 30, "one scale-up and two scale-downs counted")


def test_external_mode_never_writes_replicas(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess
) -> None:
    rest = Rest(own_apiserver)
    kube = own_kube
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "mode": "external"}}
    create_infd(kube, NS, "ext", spec)
    wait_for(lambda: rest.call("GET", deployment_path("ext-prefill"))[0] == 200, 30, "the role Deployments")
    patch = {"spec": {"replicas": 4}}
    status, body = rest.call(
        "PATCH", deployment_path("ext-prefill") + "?fieldManager=hpa", patch, "application/merge-patch+json"
    )
    assert status == 200, body

    pattern = r'baton_operator_reconciles_total\{result="ok",trigger="timer"\} (\S+)'

    def timer_reconciles() -> float:
        found = re.search(pattern, operator.metrics())
        return float(found.group(1)) if found else 0.0

    # Every resource is resynced each second; wait for several periods of both resources.
    start = timer_reconciles()
    wait_for(lambda: timer_reconciles() >= start + 8, 40, "eight more timer reconciles")
    assert replicas(rest, "ext-prefill") == 4
    managers = {m["manager"] for m in rest.get(deployment_path("ext-prefill"))["metadata"]["managedFields"]}
    assert AUTOSCALER_MANAGER not in managers
    assert "autoscaling" not in (get_infd(kube, NS, "ext").get("status") or {})


def cap_decode_replicas(rest: Rest, deployment: str, most: int) -> None:
    """An admission policy the API server enforces: `deployment` may have at most `most` replicas.
    Returns once a dry-run write above the cap is refused (policies take effect asynchronously)."""
    name = f"cap-{deployment}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["deployments"],
                    }
                ]
            },
            "matchConditions": [
                {"name": "this-one", "expression": f"object.metadata.name == '{deployment}'"}
            ],
            "validations": [
                {"expression": f"object.spec.replicas <= {most}", "message": f"at most {most} replicas"}
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    base = "/apis/admissionregistration.k8s.io/v1"
    for path, body in (
        (f"{base}/validatingadmissionpolicies", policy),
        (f"{base}/validatingadmissionpolicybindings", binding),
    ):
        status, answer = rest.call("POST", path, body)
        assert status == 201, answer
    over = {"spec": {"replicas": most + 1}}

    def refused() -> bool:
        status, _ = rest.call(
            "PATCH", deployment_path(deployment) + "?dryRun=All", over, "application/merge-patch+json"
        )
        return status == 422

    wait_for(refused, 30, f"the API server to enforce the cap on {deployment}")


def test_a_resize_is_reported_even_when_another_pool_fails_to_resize(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    rest = Rest(own_apiserver)
    create_infd(own_kube, NS, "capped", SPEC)
    wait_for(lambda: rest.call("GET", deployment_path("capped-decode"))[0] == 200, 30, "the role Deployments")
    cap_decode_replicas(rest, "capped-decode", 1)
    for role, load in loads.items():
        add_ready_pod(rest, "capped", role, load.port)

    def posted(reason: str) -> list[str]:
        events = rest.get(f"/api/v1/namespaces/{NS}/events")["items"]
        return [
            e["message"] for e in events if e["involvedObject"]["name"] == "capped" and e["reason"] == reason
        ]

    # Both pools want to grow: prefill (written first) to 3, decode to 2, which the cap refuses.
    loads["prefill"].waiting, loads["decode"].kv = 6, 0.9
    wait_for(lambda: replicas(rest, "capped-prefill") == 3, 30, "prefill scaled to 3")
    failures = wait_for(lambda: (f := posted("AutoscalerFailed")) and len(f) >= 3 and f, 30, "3 failed ticks")
    assert "at most 1 replicas" in failures[0]
    assert replicas(rest, "capped-decode") == 1
    assert posted("ScaledUp") == ["prefill: scale up 1 -> 3: recommend 3 (queue depth 6 / target 2 -> 3)"]
