"""The in-memory object cache: slim copies, newest resourceVersion wins, change detection."""

from __future__ import annotations

from typing import Any

import pytest

from baton_operator.object_cache import DEPLOYMENT_FIELDS, ObjectCache, resource_version, slim


def deployment(rv: str | None, ready: int = 0, uid: str = "u1", replicas: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo-decode", "namespace": "ns", "uid": uid, "generation": 1}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {
        "metadata": {**meta, "labels": {"a": "b"}, "managedFields": [{"manager": "m"}]},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": []}}},
        "status": {"readyReplicas": ready, "conditions": [{"type": "Available"}]},
    }


def test_slim_keeps_identity_and_the_named_fields_only() -> None:
    got = slim(deployment("7", ready=1), DEPLOYMENT_FIELDS)
    assert got == {
        "metadata": {
            "name": "demo-decode",
            "namespace": "ns",
            "uid": "u1",
            "generation": 1,
            "resourceVersion": "7",
        },
        "spec": {"replicas": 1},
        "status": {"readyReplicas": 1, "conditions": [{"type": "Available"}]},
    }
    assert slim({"metadata": {"name": "x"}}, DEPLOYMENT_FIELDS) == {"metadata": {"name": "x"}}


def test_slim_copies_so_later_mutation_of_the_source_is_not_seen() -> None:
    source = deployment("7")
    got = slim(source, DEPLOYMENT_FIELDS)
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
        ([deployment("5"), deployment("6")], False, 0),  # newer, but the cached fields are equal
        ([deployment("5"), deployment("6", ready=1)], True, 1),
        ([deployment("5"), deployment("6", replicas=3)], True, 0),  # spec.replicas counts
        ([deployment("6", ready=1), deployment("5")], False, 1),  # a late, older event is ignored
        ([deployment("6", ready=1), deployment("5", uid="u2")], True, 0),  # recreated: new uid
        ([deployment("6", ready=1), deployment(None)], True, 0),  # no resourceVersion: replaces
        ([deployment("9"), deployment("10", ready=1)], True, 1),  # compared as numbers, not text
    ],
)
def test_observe(seen: list[dict[str, Any]], changed: bool, ready: int) -> None:
    cache = ObjectCache(DEPLOYMENT_FIELDS)
    results = [cache.observe(obj) for obj in seen]
    assert results[-1] is changed
    held = cache.get("ns", "demo-decode")
    assert held is not None and held["status"]["readyReplicas"] == ready
    assert len(cache) == 1


def test_forget_only_the_deleted_object() -> None:
    cache = ObjectCache(DEPLOYMENT_FIELDS)
    cache.observe(deployment("5", uid="u2"))
    cache.forget(deployment("4", uid="u1"))  # an older object of the same name was deleted
    assert cache.get("ns", "demo-decode") is not None
    cache.forget(deployment("6", uid="u2"))
    assert cache.get("ns", "demo-decode") is None
    cache.forget(deployment("6", uid="u2"))  # twice: nothing to do
    assert len(cache) == 0
