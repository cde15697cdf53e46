"""The built-in autoscaler inside `baton-operator run` (the chart's ServiceAccount) on a real API
server. Engine pods are Pod objects whose status the test writes (no kubelet here) pointing at
real HTTP servers that answer /metrics with the load the test sets.

Covers: scale-up under baton-autoscaler's field manager, the operator's own reconciles not
reverting it, status.autoscaling, ScaledUp/ScaledDown Events, the scale-action metric, scale-down
one step per stabilization window, `external` mode never writing replicas, and a pool whose
replica write is refused (by an admission policy): the other pool's resize recorded once (status
history, Event, metric), its down-window honoured, the refusal reported per tick."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from baton_operator.autoscaler.status_record import STATUS_HEARTBEAT_S
from baton_operator.autoscaler.tick import FIELD_MANAGER as AUTOSCALER_MANAGER
from baton_operator.kube import FIELD_MANAGER
from baton_operator.runner import LAST_HANDLED_ANNOTATION
from baton_support.apiserver import ApiServer, Rest
from baton_support.fake_engines import (
    Load,
    add_ready_pod,
    autoscaled_spec,
    deployment_path,
    replicas,
)
from baton_support.operator_process import OperatorProcess, operator_process
from baton_support.wait import wait_for
from tests.operator_tests.autoscaler.admission import Refusal, refused, replicas_cap
from tests.operator_tests.kube_helpers import create_infd, create_namespace, get_infd
from tests.operator_tests.watching import Watch

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NS = "autoscale"
WINDOW_S = 3
SPEC = autoscaled_spec(WINDOW_S)
ROLES = ("prefill", "decode")


@pytest.fixture(scope="module")
def operator(own_apiserver: ApiServer, own_kube: Any, chart_installed: Any) -> Iterator[OperatorProcess]:
    kubeconfig, _ = chart_installed
    create_namespace(own_kube, NS)
    with operator_process(kubeconfig, own_apiserver.workdir, "--resync-seconds=1") as proc:
        yield proc


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def timer_reconciles(operator: OperatorProcess) -> float:
    """The operator's successful periodic reconciles so far (of every resource)."""
    found = re.search(
        r'baton_operator_reconciles_total\{result="ok",trigger="timer"\} (\S+)', operator.metrics()
    )
    return float(found.group(1)) if found else 0.0


def create_running(
    rest: Rest, kube: Any, name: str, spec: dict[str, Any], loads: dict[str, Load] | None = None
) -> None:
    """InferenceDeployment `name` once its role Deployments exist, with a Ready engine pod per
    role of `loads` answering that role's load."""
    create_infd(kube, NS, name, spec)
    wait_for(
        lambda: all(rest.call("GET", deployment_path(NS, f"{name}-{role}"))[0] == 200 for role in ROLES),
        timeout=30,
        interval=0.1,
        message="the role Deployments",
    )
    for role, load in (loads or {}).items():
        add_ready_pod(rest, NS, name, role, load.port)


def test_builtin_scales_up_then_down_one_step_per_window(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    rest = Rest(own_apiserver)
    kube = own_kube
    create_running(rest, kube, "grow", SPEC, loads)

    # Idle: the autoscaler decides "hold" and says so in status.
    def held() -> dict[str, Any] | None:
        auto = get_infd(kube, NS, "grow").get("status", {}).get("autoscaling") or {}
        return auto if auto.get("action") == "hold" and auto.get("scrapedAt") else None

    status = wait_for(held, timeout=30, interval=0.1, message="a first 'hold' decision in status.autoscaling")
    assert status["lastDecision"] == {"prefill": 1, "decode": 1}
    assert status["currentReplicas"] == {"prefill": 1, "decode": 1}

    # A tick writes the replicas, then status.autoscaling, then posts its Events (Kopf sends
    # those from a queue) and counts the action: each is waited for on its own.
    def decided(prefill: int) -> dict[str, Any] | None:
        auto = get_infd(kube, NS, "grow")["status"]["autoscaling"]
        return auto if auto["lastDecision"]["prefill"] == prefill else None

    loads["prefill"].waiting = 6  # 6 waiting / target 2 -> 3 prefill pods
    wait_for(
        lambda: replicas(rest, NS, "grow-prefill") == 3,
        timeout=30,
        interval=0.1,
        message="prefill scaled to 3",
    )
    deployment = rest.get(deployment_path(NS, "grow-prefill"))
    owners = {
        m["manager"]: json.dumps(m.get("fieldsV1", {})) for m in deployment["metadata"]["managedFields"]
    }
    assert '"f:replicas"' in owners[AUTOSCALER_MANAGER]
    assert '"f:replicas"' not in owners[FIELD_MANAGER]
    auto = wait_for(
        lambda: decided(3), timeout=30, interval=0.1, message="status.autoscaling to record the scale-up to 3"
    )
    assert auto["metrics"]["prefill.waitingRequests"] == 6.0
    assert "scale up 1 -> 3" in auto["reason"]

    # The operator's own reconciles (every second) leave the autoscaler's replicas alone.
    before = timer_reconciles(operator)
    wait_for(
        lambda: timer_reconciles(operator) >= before + 3,
        timeout=30,
        interval=0.1,
        message="three more timer reconciles",
    )
    assert replicas(rest, NS, "grow-prefill") == 3

    # Load stops: one step down per window, to the minimum.
    loads["prefill"].waiting = 0
    wait_for(
        lambda: replicas(rest, NS, "grow-prefill") == 1, timeout=60, interval=0.1, message="prefill back to 1"
    )
    assert replicas(rest, NS, "grow-decode") == 1

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

    steps = wait_for(
        lambda: (s := prefill_steps()) and len(s) >= 3 and s,
        timeout=30,
        interval=0.1,
        message="the scale-down Events",
    )
    assert steps == [
        ("up", "1", "3"),
        ("down", "3", "2"),
        ("down", "2", "1"),
    ]
    # At most one scale-down per window: the status history keeps the last one's time.
    auto = wait_for(
        lambda: decided(1),
        timeout=30,
        interval=0.1,
        message="status.autoscaling to record the scale-down to 1",
    )
    last_down = [a for a in json.loads(auto["history"])["actions"] if a[1] == "prefill"]
    assert [a[2:] for a in last_down][-1:] == [[2, 1]]

    def actions() -> tuple[float, float]:
        text = operator.metrics()
        series = "baton_autoscaler_scale_actions_total"
        up = counter(text, series, deployment="grow", role="prefill", direction="up")
        down = counter(text, series, deployment="grow", role="prefill", direction="down")
        return up, down

    wait_for(
        lambda: actions() == (1.0, 2.0),
        timeout=30,
        interval=0.1,
        message="one scale-up and two scale-downs counted",
    )


def test_external_mode_never_writes_replicas(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess
) -> None:
    rest = Rest(own_apiserver)
    kube = own_kube
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "mode": "external"}}
    create_running(rest, kube, "ext", spec)
    patch = {"spec": {"replicas": 4}}
    status, body = rest.call(
        "PATCH",
        deployment_path(NS, "ext-prefill") + "?fieldManager=hpa",
        patch,
        "application/merge-patch+json",
    )
    assert status == 200, body

    # Every resource is resynced each second; wait for several periods of both resources.
    before = timer_reconciles(operator)
    wait_for(
        lambda: timer_reconciles(operator) >= before + 8,
        timeout=40,
        interval=0.1,
        message="eight more timer reconciles",
    )
    assert replicas(rest, NS, "ext-prefill") == 4
    managers = {
        m["manager"] for m in rest.get(deployment_path(NS, "ext-prefill"))["metadata"]["managedFields"]
    }
    assert AUTOSCALER_MANAGER not in managers
    assert "autoscaling" not in (get_infd(kube, NS, "ext").get("status") or {})


def test_a_steady_load_does_not_rewrite_the_resource(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    """Builtin mode at a steady load: once the resource's first writes are done, five more
    decisions (and the resyncs between them) leave it untouched: no watch event, no new
    resourceVersion for GitOps tools to see."""
    rest = Rest(own_apiserver)
    create_running(rest, own_kube, "steady", SPEC, loads)

    def written() -> dict[str, Any] | None:
        # The writes that follow a creation, each once: Kopf's record of the handled creation,
        # the reconcile's conditions, and a decision that saw both engine pods (a tick between
        # the two pods' arrival decides on prefill's alone, and the next one has decode's too).
        body = get_infd(own_kube, NS, "steady")
        status = body.get("status") or {}
        auto = status.get("autoscaling") or {}
        handled = LAST_HANDLED_ANNOTATION in (body["metadata"].get("annotations") or {})
        ready = any(c["type"] == "Ready" for c in status.get("conditions", []))
        known = {role: (auto.get("metrics") or {}).get(f"{role}.knownPods") for role in ROLES}
        both = known == {"prefill": 1, "decode": 1}
        return body if handled and ready and auto.get("action") == "hold" and both else None

    body = wait_for(
        written, timeout=30, interval=0.1, message="a 'hold' decision on both pods in status.autoscaling"
    )
    assert body["status"]["autoscaling"]["lastDecision"] == {"prefill": 1, "decode": 1}
    decided_at = dt.datetime.fromisoformat(body["status"]["autoscaling"]["time"]).timestamp()

    def decisions() -> float:
        return counter(operator.metrics(), "baton_autoscaler_decisions_total", deployment="steady")

    infds = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
    with Watch(
        own_apiserver, infds, body["metadata"]["resourceVersion"], field_selector="metadata.name=steady"
    ) as w:
        before = decisions()
        # Within the heartbeat: a decision stored a minute ago is rewritten by design.
        wait_for(
            lambda: decisions() >= before + 5,
            timeout=decided_at + STATUS_HEARTBEAT_S - time.time(),
            interval=0.1,
            message="five more decisions within the status heartbeat",
        )
    assert [(kind, obj["metadata"]["resourceVersion"]) for kind, obj in w.events()] == []


#: A down-window longer than the test: a second prefill action inside it would be the bug.
CAPPED_WINDOW_S = 120
CAPPED_SPEC: dict[str, Any] = {
    **SPEC,
    "autoscaling": {
        **SPEC["autoscaling"],
        "scaleDown": {"stabilizationWindowSeconds": CAPPED_WINDOW_S, "maxStep": 1},
    },
}


def posted(rest: Rest, name: str, reason: str) -> list[str]:
    """Messages of the Events about InferenceDeployment `name` with `reason`."""
    events = rest.get(f"/api/v1/namespaces/{NS}/events")["items"]
    return [e["message"] for e in events if e["involvedObject"]["name"] == name and e["reason"] == reason]


def start_capped(rest: Rest, kube: Any, loads: dict[str, Load], name: str, capped_role: str) -> Refusal:
    """InferenceDeployment `name` with its engine pods; the cap on `capped_role` (at most 1) to enter."""
    create_running(rest, kube, name, CAPPED_SPEC, loads)
    deployment = f"{name}-{capped_role}"
    return replicas_cap(deployment_path(NS, deployment), deployment, 1)


def test_a_refused_pool_write_keeps_the_other_pools_action_recorded_once(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    rest = Rest(own_apiserver)
    cap = start_capped(rest, own_kube, loads, "capped", "decode")

    def autoscaling() -> dict[str, Any]:
        return dict(get_infd(own_kube, NS, "capped").get("status", {}).get("autoscaling") or {})

    def actions() -> list[list[Any]]:
        return list(json.loads(autoscaling().get("history") or "{}").get("actions", []))

    with refused(rest, cap):
        # Both pools want to grow: prefill to 3, decode to 2, which the cap refuses every tick.
        loads["prefill"].waiting, loads["decode"].kv = 6, 0.9
        wait_for(
            lambda: replicas(rest, NS, "capped-prefill") == 3,
            timeout=30,
            interval=0.1,
            message="prefill scaled to 3",
        )
        wait_for(
            lambda: actions(),
            timeout=30,
            interval=0.1,
            message="the prefill scale-up in status.autoscaling.history",
        )

        # Prefill's load goes; decode's writes keep failing. Prefill holds for the down-window:
        # the recommendations of the failed ticks are in the history too.
        loads["prefill"].waiting = 0
        holding = (
            "prefill: hold at 3: recommend 1 (queue depth 0 / target 2 -> 0, raised to minReplicas 1); "
            f"highest in the last {CAPPED_WINDOW_S}s: 3"
        )
        wait_for(
            lambda: holding in autoscaling().get("reason", ""),
            timeout=30,
            interval=0.1,
            message="prefill holding at 3 with no load",
        )
        seen = len(posted(rest, "capped", "ScaleFailed"))
        wait_for(
            lambda: len(posted(rest, "capped", "ScaleFailed")) >= seen + 3,
            timeout=30,
            interval=0.1,
            message="3 more refused decode writes",
        )

        assert (replicas(rest, NS, "capped-prefill"), replicas(rest, NS, "capped-decode")) == (3, 1)
        assert [a[1:] for a in actions()] == [["prefill", 1, 3]]
        # Events are sent from Kopf's queue, the failure count after the tick's status write.
        wait_for(
            lambda: posted(rest, "capped", "ScaledUp"), timeout=30, interval=0.1, message="the ScaledUp Event"
        )
        assert posted(rest, "capped", "ScaledUp") == [
            "prefill: scale up 1 -> 3: recommend 3 (queue depth 6 / target 2 -> 3)"
        ]
        assert posted(rest, "capped", "ScaledDown") == []
        assert set(posted(rest, "capped", "ScaleFailed")) == {
            "decode: scale up 1 -> 2 not written: Invalid (HTTP 422): "
            'deployments.apps "capped-decode" is forbidden: ValidatingAdmissionPolicy '
            "'cap-capped-decode' with binding 'cap-capped-decode' denied request: at most 1 replicas"
        }
        failed = "baton_autoscaler_scale_failures_total"
        text = wait_for(
            lambda: (
                (t := operator.metrics())
                and counter(t, failed, deployment="capped", role="decode") >= seen + 3
                and t
            ),
            timeout=30,
            interval=0.1,
            message="3 more refused decode writes counted",
        )
    action = "baton_autoscaler_scale_actions_total"
    assert counter(text, action, deployment="capped", role="prefill", direction="up") == 1.0
    assert counter(text, action, deployment="capped") == 1.0
    assert counter(text, failed, deployment="capped") == counter(
        text, failed, deployment="capped", role="decode", direction="up"
    )
    # Kopf logs each failed tick and runs the daemon again (no AutoscalerFailed: nothing else failed).
    wait_for(
        lambda: "replicas not written: decode: Invalid (HTTP 422)" in operator.log_text(),
        timeout=30,
        interval=0.1,
        message="Kopf's log",
    )
    assert posted(rest, "capped", "AutoscalerFailed") == []


def test_a_refused_first_write_does_not_stop_the_second_pools(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, loads: dict[str, Load]
) -> None:
    rest = Rest(own_apiserver)
    cap = start_capped(rest, own_kube, loads, "first", "prefill")  # prefill is written first
    with refused(rest, cap):
        loads["prefill"].waiting, loads["decode"].kv = 6, 0.9
        wait_for(
            lambda: replicas(rest, NS, "first-decode") == 2,
            timeout=30,
            interval=0.1,
            message="decode scaled to 2",
        )
        wait_for(
            lambda: len(posted(rest, "first", "ScaleFailed")) >= 2,
            timeout=30,
            interval=0.1,
            message="2 refused prefill writes",
        )
        assert replicas(rest, NS, "first-prefill") == 1
        wait_for(
            lambda: posted(rest, "first", "ScaledUp"), timeout=30, interval=0.1, message="the ScaledUp Event"
        )
        assert posted(rest, "first", "ScaledUp") == [
            "decode: scale up 1 -> 2: recommend 2 (KV usage 0.90 x 1 pod / target 0.50 -> 2)"
        ]
        assert set(posted(rest, "first", "ScaleFailed")) == {
            "prefill: scale up 1 -> 3 not written: Invalid (HTTP 422): "
            'deployments.apps "first-prefill" is forbidden: ValidatingAdmissionPolicy '
            "'cap-first-prefill' with binding 'cap-first-prefill' denied request: at most 1 replicas"
        }
        history = json.loads(get_infd(own_kube, NS, "first")["status"]["autoscaling"]["history"])
        assert [a[1:] for a in history["actions"]] == [["decode", 1, 2]]
