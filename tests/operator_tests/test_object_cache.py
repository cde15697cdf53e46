"""The in-memory object cache: slim copies, newest resourceVersion wins, change detection."""

from __future__ import annotations

from typing import Any

import pytest

from baton_operator.object_cache import (
    ObjectCache,
    deployment_view,
    owner_view,
    replicas_managers,
    resource_version,
    slim,
)


def deployment(rv: str | None, ready: int = 0, uid: str = "u1", replicas: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo-decode", "namespace": "ns", "uid": uid, "generation": 1}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {
        "metadata": {**meta, "labels": {"a": "b"}, "managedFields": [{"manager": "m"}]},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": []}}},
        "status": {
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "MinimumReplicasAvailable",
                    "message": "ok",
                    "lastUpdateTime": f"2026-01-01T00:00:{rv or 0:0>2}Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        },
    }


AVAILABLE = {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable", "message": "ok"}


def test_deployment_view_keeps_identity_counts_and_conditions_without_timestamps() -> None:
    assert deployment_view(deployment("7", ready=1)) == {
        "metadata": {
            "name": "demo-decode",
            "namespace": "ns",
            "uid": "u1",
            "generation": 1,
            "resourceVersion": "7",
        },
        "spec": {"replicas": 1},
        "status": {"readyReplicas": 1, "conditions": [AVAILABLE]},
        "replicasManagers": [],
    }
    assert deployment_view({"metadata": {"name": "x"}}) == {
        "metadata": {"name": "x"},
        "status": {},
        "replicasManagers": [],
    }


def test_replicas_managers_are_the_managers_owning_spec_replicas() -> None:
    obj = deployment("1")
    obj["metadata"]["managedFields"] = [
        {"manager": "baton-operator", "operation": "Apply", "fieldsV1": {"f:spec": {"f:template": {}}}},
        {
            "manager": "hpa",
            "operation": "Update",
            "subresource": "scale",
            "fieldsV1": {"f:spec": {"f:replicas": {}}},
        },
        {"manager": "baton-autoscaler", "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
        {"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}},
    ]
    assert replicas_managers(obj) == ["baton-autoscaler", "hpa"]
    assert deployment_view(obj)["replicasManagers"] == ["baton-autoscaler", "hpa"]


def test_owner_view_keeps_what_a_refresh_reads_and_the_operators_status_only() -> None:
    owner = {
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u", "generation": 2, "labels": {"a": "b"}},
        "spec": {
            "model": {"name": "m", "source": "builtin:x"},
            "mode": "aggregated",
            "router": {"service": {"port": 81}},
            "engine": {"maxNumSeqs": 8},
        },
        "status": {
            "observedGeneration": 2,
            "endpoint": "http://demo-router.ns.svc:81",
            "autoscaling": {"history": [1, 2, 3]},
        },
    }
    assert owner_view(owner) == {
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u", "generation": 2},
        "spec": {
            "model": {"name": "m", "source": "builtin:x"},
            "mode": "aggregated",
            "router": {"service": {"port": 81}},
            "engine": {"maxNumSeqs": 8},  # the pools' KV-compatibility keys read it
        },
        "status": {"observedGeneration": 2, "endpoint": "http://demo-router.ns.svc:81"},
    }


def test_slim_copies_so_later_mutation_of_the_source_is_not_seen() -> None:
    source = {"metadata": {"name": "x"}, "status": {"conditions": [{"type": "Available"}]}}
    got = slim(source, ("status",))
    source["status"]["conditions"].append({"type": "Progressing"})
    assert got["status"]["conditions"] == [{"type": "Available"}]


@pytest.mark.parametrize(("rv", "expected"), [("12", 12), (None, None), ("abc", None)])
def test_resource_version(rv: str | None, expected: int | None) -> None:
    assert resource_version(deployment(rv)) == expected


# (sequence of observed objects, expected return of the last observe, expected cached readyReplicas)
@pytest.mark.parametrize(
    ("seen", "changed", "ready"),
    [
        ([deployment("5")], True, 0),  # first sight
        ([deployment("5"), deployment("5")], False, 0),  # the same version again (watch after apply)
        ([deployment("5"), deployment("6")], False, 0),  # newer, only a condition re-stamped
        ([deployment("5"), deployment("6", ready=1)], True, 1),
        ([deployment("5"), deployment("6", replicas=3)], True, 0),  # spec.replicas counts
        ([deployment("6", ready=1), deployment("5")], False, 1),  # a late, older event is ignored
        ([deployment("6", ready=1), deployment("7", uid="u2")], True, 0),  # recreated: new uid
        ([deployment("7", uid="u2"), deployment("6", ready=1)], False, 0),  # the predecessor, late
        ([deployment("6", ready=1), deployment(None)], True, 0),  # no resourceVersion: replaces
        ([deployment("9"), deployment("10", ready=1)], True, 1),  # compared as numbers, not text
    ],
)
def test_observe(seen: list[dict[str, Any]], changed: bool, ready: int) -> None:
    cache = ObjectCache(deployment_view)
    results = [cache.observe(obj) for obj in seen]
    assert results[-1] is changed
    held = cache.get("ns", "demo-decode")
    assert held is not None and held["status"]["readyReplicas"] == ready
    assert len(cache) == 1


def test_a_deleted_uid_is_never_taken_back() -> None:
    cache = ObjectCache(deployment_view)
    cache.observe(deployment("5"))
    cache.forget(deployment("6"))
    assert cache.observe(deployment("6")) is False  # a handler's late copy of the deleted object
    assert cache.get("ns", "demo-decode") is None and cache.uid("ns", "demo-decode") is None
    assert cache.observe(deployment("8", uid="u2")) is True  # re-created under the same name
    assert cache.uid("ns", "demo-decode") == "u2"


def test_forget_only_the_deleted_object() -> None:
    cache = ObjectCache(deployment_view)
    cache.observe(deployment("5", uid="u2"))
    cache.forget(deployment("4", uid="u1"))  # an older object of the same name was deleted
    assert cache.get("ns", "demo-decode") is not None
    cache.forget(deployment("6", uid="u2"))
    assert cache.get("ns", "demo-decode") is None
    cache.forget(deployment("6", uid="u2"))  # twice: nothing to do
    assert len(cache) == 0
