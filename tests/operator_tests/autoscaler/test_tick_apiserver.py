"""One autoscaler tick against a real API server whose admission policy refuses the resource's
status writes: the replicas written are still in the returned history (the handler keeps it), the
failure is in the result, and the next tick honours the window the failed one began."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from baton_operator import models
from baton_operator.autoscaler.policy_types import History, ScaleAction
from baton_operator.autoscaler.tick import autoscale_once
from baton_operator.events import Event
from baton_operator.kube import Kube, collection_path, object_path
from baton_support.apiserver import ApiServer, Rest
from baton_support.fake_engines import Load, add_ready_pod, autoscaled_spec, replicas
from tests.operator_tests.autoscaler.admission import Refusal, refused
from tests.operator_tests.kube_helpers import create_infd, create_namespace, get_infd

pytestmark = pytest.mark.k8s

NS = "tick-status"
NAME = "tick-nostatus"
WINDOW_S = 120
SPEC = autoscaled_spec(WINDOW_S)


def create_role_deployment(rest: Rest, name: str, namespace: str = NS) -> None:
    """What the reconcile would have created, as far as the autoscaler reads it: one replica."""
    labels = {"app": name}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "engine", "image": "baton"}]},
            },
        },
    }
    status, answer = rest.call("POST", collection_path("apps/v1", "Deployment", namespace), deployment)
    assert status == 201, answer


async def test_a_status_not_saved_keeps_the_written_action_in_the_returned_history(
    apiserver: ApiServer, kube: Any, akube: Kube, loads: dict[str, Load]
) -> None:
    rest = Rest(apiserver)
    create_namespace(kube, NS)
    create_infd(kube, NS, NAME, SPEC)
    for role, load in loads.items():
        create_role_deployment(rest, f"{NAME}-{role}")
        add_ready_pod(rest, NS, NAME, role, load.port)
    no_status = Refusal(
        "refuse-tick-status",
        models.GROUP,
        f"{models.PLURAL}/status",
        NAME,
        "false",
        "status writes refused",
        object_path(models.API_VERSION, models.KIND, NS, NAME) + "/status",
        {"status": {"autoscaling": {"reason": "probe"}}},
    )
    events: list[Event] = []
    loads["prefill"].waiting = 6
    async with httpx.AsyncClient(timeout=30) as client:
        with refused(rest, no_status):
            first = await autoscale_once(
                akube, get_infd(kube, NS, NAME), History(), client=client, on_event=events.append
            )
        assert first is not None
        assert first.failures == [
            f'status not saved: HTTP 422: {models.PLURAL}.{models.GROUP} "{NAME}" is forbidden: '
            "ValidatingAdmissionPolicy 'refuse-tick-status' with binding 'refuse-tick-status' denied "
            "request: status writes refused"
        ]
        assert first.history.actions == (ScaleAction(first.decision.at, "prefill", 1, 3),)
        assert events == [
            Event(
                "Normal", "ScaledUp", "prefill: scale up 1 -> 3: recommend 3 (queue depth 6 / target 2 -> 3)"
            )
        ]
        assert (replicas(rest, NS, f"{NAME}-prefill"), replicas(rest, NS, f"{NAME}-decode")) == (3, 1)
        assert "autoscaling" not in (get_infd(kube, NS, NAME).get("status") or {})

        # Next tick, from the history the failed one returned: no load, and prefill holds.
        loads["prefill"].waiting = 0
        second = await autoscale_once(akube, get_infd(kube, NS, NAME), first.history, client=client)
    assert second is not None
    assert second.failures == []
    assert second.decision.role("prefill").reason == (
        "hold at 3: recommend 1 (queue depth 0 / target 2 -> 0, raised to minReplicas 1); "
        f"highest in the last {WINDOW_S}s: 3"
    )
    saved = json.loads(get_infd(kube, NS, NAME)["status"]["autoscaling"]["history"])
    assert saved["actions"] == [[round(first.decision.at, 3), "prefill", 1, 3]]


async def test_a_steady_load_leaves_the_status_unwritten(
    apiserver: ApiServer, kube: Any, akube: Kube, loads: dict[str, Load]
) -> None:
    """Same decision, metrics within their noise: nothing is written (the resource's
    resourceVersion stays); a load that moves materially is written at once."""
    rest = Rest(apiserver)
    namespace, name = "tick-steady", "steady"
    create_namespace(kube, namespace)
    create_infd(kube, namespace, name, SPEC)
    for role, load in loads.items():
        create_role_deployment(rest, f"{name}-{role}", namespace)
        add_ready_pod(rest, namespace, name, role, load.port)
    loads["decode"].kv = 0.30
    async with httpx.AsyncClient(timeout=30) as client:
        first = await autoscale_once(akube, get_infd(kube, namespace, name), History(), client=client)
        assert first is not None and first.status_change == "first decision"
        version = get_infd(kube, namespace, name)["metadata"]["resourceVersion"]
        history = first.history
        for kv in (0.31, 0.33, 0.29):  # KV usage wandering by a few hundredths
            loads["decode"].kv = kv
            tick = await autoscale_once(akube, get_infd(kube, namespace, name), history, client=client)
            assert tick is not None and (tick.decision.action, tick.status_change) == ("hold", None)
            history = tick.history
        assert get_infd(kube, namespace, name)["metadata"]["resourceVersion"] == version
        loads["prefill"].waiting = 1  # a request waiting: material (and still a hold)
        moved = await autoscale_once(akube, get_infd(kube, namespace, name), history, client=client)
    assert moved is not None and moved.status_change == "metrics prefill.waitingRequests"
    stored = get_infd(kube, namespace, name)
    assert stored["metadata"]["resourceVersion"] != version
    assert stored["status"]["autoscaling"]["metrics"]["prefill.waitingRequests"] == 1.0
    managers = {m["manager"] for m in stored["metadata"]["managedFields"] if m.get("subresource") == "status"}
    assert managers == {"baton-autoscaler"}
