"""Switching `spec.autoscaling.mode` on a real API server: the replica counts in force stay until
their new owner changes them, for every transition between off, builtin and external.

Each case starts a resource in one mode with prefill 2 and decode 3 replicas in force, written
by that mode's owner (off: the operator from spec.<role>.replicas; builtin: the autoscaler's
field manager, as its decisions do; external: an HPA-like manager through the scale
subresource; `external*`: the same after an earlier switch from off, where the HPA's update took
the field over from the handover manager: the API server records a scale update's ownership only
of a field someone owned), switches the mode and reconciles while a watch records every replica
count the Deployments take. Never 1 (the Deployment default a field without owner falls back to), the
counts in force kept (or, switching to off, the spec's 4 and 5), `spec.replicas` owned by the new
mode's manager only, and a second reconcile changes nothing. Then the new owner writes a count,
and a reconcile keeps it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from baton_operator.autoscaler.tick import FIELD_MANAGER as AUTOSCALER
from baton_operator.kube import FIELD_MANAGER as OPERATOR
from baton_operator.kube import Kube, collection_path
from baton_operator.object_cache import replicas_managers
from baton_operator.reconcile import OperatorConfig, reconcile
from baton_operator.replicas import HANDOVER, releasable, taker
from baton_support.apiserver import ApiServer, Rest
from tests.operator_tests.cases import VALID_SPEC, merged
from tests.operator_tests.kube_helpers import create_infd, create_namespace
from tests.operator_tests.watching import Watch, resource_version

pytestmark = pytest.mark.k8s

CFG = OperatorConfig()
HPA = "hpa-controller"  # what the HPA controller's scale updates are recorded as, here
ROLES = ("prefill", "decode")
IN_FORCE = {"prefill": 2, "decode": 3}
OFF_SPEC = {"prefill": 4, "decode": 5}  # spec.<role>.replicas after a switch to off
MODES = ("off", "builtin", "external")
#: (from, to) -> managers of spec.replicas once switched.
OWNERS: dict[tuple[str, str], set[str]] = {
    ("off", "builtin"): {AUTOSCALER},
    ("off", "external"): {HANDOVER},
    ("builtin", "off"): {OPERATOR},
    ("builtin", "external"): {HANDOVER},
    ("external", "off"): {OPERATOR},
    # Nobody owns a count an HPA wrote to a defaulted field: nothing to hand over, it stays, and
    # the autoscaler's first decision takes it.
    ("external", "builtin"): set(),
    ("external*", "off"): {OPERATOR},
    # The HPA still writes replicas until someone removes it: the autoscaler shares the field
    # with it until its first decision of another count.
    ("external*", "builtin"): {AUTOSCALER, HPA},
}
_namespaces = itertools.count()


def spec_for(mode: str, counts: dict[str, int]) -> dict[str, Any]:
    return merged(
        VALID_SPEC,
        {"autoscaling": {"mode": mode}, **{role: {"replicas": n} for role, n in counts.items()}},
    )


def path(namespace: str, role: str) -> str:
    return collection_path("apps/v1", "Deployment", namespace) + f"/demo-{role}"


def counts(rest: Rest, namespace: str) -> dict[str, int]:
    return {role: rest.get(path(namespace, role))["spec"]["replicas"] for role in ROLES}


def owners(rest: Rest, namespace: str) -> dict[str, set[str]]:
    return {role: set(replicas_managers(rest.get(path(namespace, role)))) for role in ROLES}


def write_as(rest: Rest, namespace: str, manager: str, values: dict[str, int]) -> None:
    """Replicas as `manager` writes them: the autoscaler by apply, an HPA by the scale subresource."""
    for role, n in values.items():
        if manager == HPA:
            status, body = rest.call(
                "PATCH",
                path(namespace, role) + f"/scale?fieldManager={HPA}",
                {"spec": {"replicas": n}},
                "application/merge-patch+json",
            )
        else:
            apply = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"demo-{role}"}}
            status, body = rest.call(
                "PATCH",
                path(namespace, role) + f"?fieldManager={manager}&force=true",
                {**apply, "spec": {"replicas": n}},
                "application/apply-patch+yaml",
            )
        assert status == 200, body


def switch(rest: Rest, namespace: str, mode: str) -> dict[str, Any]:
    patch: dict[str, Any] = {"spec": {"autoscaling": {"mode": mode}}}
    if mode == "off":
        patch["spec"].update({role: {"replicas": n} for role, n in OFF_SPEC.items()})
    infd = collection_path("baton.dev/v1alpha1", "InferenceDeployment", namespace) + "/demo"
    status, body = rest.call("PATCH", infd, patch, "application/merge-patch+json")
    assert status == 200, body
    return body


@pytest.mark.parametrize(("before", "after"), list(OWNERS), ids=lambda m: str(m))
async def test_a_mode_switch_keeps_the_replicas_in_force(
    apiserver: ApiServer, kube: Any, akube: Kube, before: str, after: str
) -> None:
    rest = Rest(apiserver)
    namespace = f"handover-{next(_namespaces)}"
    create_namespace(kube, namespace)
    body = create_infd(
        kube, namespace, "demo", spec_for("off" if before == "external*" else before, IN_FORCE)
    )
    await reconcile(akube, body, CFG)
    if before == "builtin":
        write_as(rest, namespace, AUTOSCALER, IN_FORCE)
    elif before == "external":
        write_as(rest, namespace, HPA, IN_FORCE)
    elif before == "external*":
        await reconcile(akube, switch(rest, namespace, "external"), CFG)
        write_as(rest, namespace, HPA, {"prefill": 1, "decode": 1})
        write_as(rest, namespace, HPA, IN_FORCE)
        assert owners(rest, namespace) == {role: {HPA} for role in ROLES}
    assert counts(rest, namespace) == IN_FORCE

    deployments = collection_path("apps/v1", "Deployment", namespace)
    with Watch(apiserver, deployments, resource_version(apiserver, deployments)) as watch:
        await reconcile(akube, switch(rest, namespace, after), CFG)
        settled = counts(rest, namespace)
    expected = OFF_SPEC if after == "off" else IN_FORCE
    assert settled == expected
    seen = {
        role: {
            obj["spec"]["replicas"] for _, obj in watch.events() if obj["metadata"]["name"] == f"demo-{role}"
        }
        for role in ROLES
    }
    for role in ROLES:
        assert seen[role] <= {IN_FORCE[role], expected[role]}, (role, seen[role])
    assert owners(rest, namespace) == {role: OWNERS[(before, after)] for role in ROLES}

    versions = {role: rest.get(path(namespace, role))["metadata"]["resourceVersion"] for role in ROLES}
    await reconcile(
        akube, (await akube.get("baton.dev/v1alpha1", "InferenceDeployment", namespace, "demo")) or {}, CFG
    )
    assert {
        role: rest.get(path(namespace, role))["metadata"]["resourceVersion"] for role in ROLES
    } == versions

    # The new owner changes the counts; the operator's next reconcile keeps them.
    if after != "off":
        changed = {"prefill": 6, "decode": 7}
        write_as(rest, namespace, AUTOSCALER if after == "builtin" else HPA, changed)
        await reconcile(
            akube,
            (await akube.get("baton.dev/v1alpha1", "InferenceDeployment", namespace, "demo")) or {},
            CFG,
        )
        assert counts(rest, namespace) == changed
        expected_owner = {AUTOSCALER} if after == "builtin" else {HPA}
        assert owners(rest, namespace) == {role: expected_owner for role in ROLES}


@pytest.mark.parametrize(
    ("mode", "managers", "first", "released"),
    [
        ("off", [OPERATOR], None, []),
        ("off", [AUTOSCALER], None, []),  # the operator's own apply takes it (forced)
        ("off", [AUTOSCALER, OPERATOR], None, [AUTOSCALER]),
        ("off", [HANDOVER, OPERATOR], None, [HANDOVER]),
        ("builtin", [], None, []),  # nobody owns a defaulted count: nothing to keep
        ("builtin", [OPERATOR], AUTOSCALER, []),
        ("builtin", [AUTOSCALER, OPERATOR], None, [OPERATOR]),
        ("builtin", [HANDOVER], AUTOSCALER, []),
        ("builtin", [AUTOSCALER, HANDOVER], None, [HANDOVER]),
        ("builtin", [HPA], AUTOSCALER, []),
        ("external", [OPERATOR], HANDOVER, []),
        ("external", [AUTOSCALER], HANDOVER, []),
        ("external", [AUTOSCALER, HANDOVER], None, [AUTOSCALER]),
        ("external", [HPA], None, []),  # the external owner has it already
        ("external", [AUTOSCALER, HPA], None, [AUTOSCALER]),
        ("external", [HANDOVER], None, []),
    ],
)
def test_who_takes_and_who_lets_go(
    mode: str, managers: list[str], first: str | None, released: list[str]
) -> None:
    assert taker(mode, managers) == first
    assert releasable(mode, managers) == released
