"""Who owns each engine pool's `spec.replicas`, and the server-side-apply handover when that
changes with `spec.autoscaling.mode`.

The API server removes a field when the last manager that owned it applies a configuration
without it; the Deployment default (1 replica) then takes over. So the operator never lets go of
`spec.replicas` before the mode's owner holds the count in force (the "transferring ownership"
recipe of the server-side-apply documentation: the new manager applies the same value, sharing
the field, then the old one leaves it out):

- `off`: the operator (`baton-operator`) applies `spec.<role>.replicas` itself;
- `builtin`: the autoscaler (`baton-autoscaler`) first applies the count in force, then the
  operator's apply leaves it out, and the autoscaler's decisions change it from there;
- `external`: `baton-handover` holds the count in force until HPA or KEDA writes replicas (an
  update takes the field over from appliers), unless one of them owns it already.

Once the mode's owner (or an external one) holds the field, the other Baton managers let go of
it, so `managedFields` says who owns the replicas. A Deployment whose replicas nobody owns (the
API's default of a Deployment created without them) has nothing to hand over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from baton_operator.autoscaler.tick import FIELD_MANAGER as AUTOSCALER
from baton_operator.kube import FIELD_MANAGER as OPERATOR
from baton_operator.kube import Kube
from baton_operator.object_cache import ObjectCache, replicas_managers

HANDOVER = "baton-handover"
BATON_MANAGERS = frozenset({OPERATOR, AUTOSCALER, HANDOVER})
OWNER_OF_MODE: dict[str, str] = {"off": OPERATOR, "builtin": AUTOSCALER, "external": HANDOVER}


def taker(mode: str, managers: Sequence[str]) -> str | None:
    """The manager that must apply the count in force before the operator's apply, or None:
    when nobody owns the field, when the mode's owner does, when the mode is off (the
    operator's own apply sets the count), or in external mode when an external manager does."""
    owner = OWNER_OF_MODE[mode]
    if mode == "off" or not managers or owner in managers:
        return None
    if mode == "external" and any(m not in BATON_MANAGERS for m in managers):
        return None
    return owner


def releasable(mode: str, managers: Sequence[str]) -> list[str]:
    """The Baton managers other than the mode's owner that still own the field, once a manager
    that keeps it (the mode's owner, or an external one) owns it too; else none."""
    owner = OWNER_OF_MODE[mode]
    stale = [m for m in managers if m in BATON_MANAGERS and m != owner]
    keepers = [m for m in managers if m not in stale]
    return stale if keepers else []


def _identity(deployment: Mapping[str, Any]) -> dict[str, Any]:
    meta = deployment["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
    }


async def take_over(
    kube: Kube, deployments: ObjectCache, manifest: Mapping[str, Any], mode: str, guard: Callable[[], None]
) -> None:
    """Before the operator applies a pool's Deployment: the mode's owner applies the count in
    force when it must (see `taker`). The count is read fresh (the cache may lag, and a count
    the new owner did not take would be reset by the operator's apply); a conflict (the count
    changed meanwhile) raises, so that the operator's apply is not sent."""
    if mode == "off":
        return  # the operator's own apply sets the count (nothing to read)
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    cached = deployments.get(namespace, name)
    if cached is not None and taker(mode, cached.get("replicasManagers") or []) is None:
        return
    current = await kube.get("apps/v1", "Deployment", namespace, name)
    if current is None:
        return
    deployments.observe(current)
    manager = taker(mode, replicas_managers(current))
    replicas = (current.get("spec") or {}).get("replicas")
    if manager is None or not isinstance(replicas, int):
        return
    guard()
    claim = {**_identity(current), "spec": {"replicas": replicas}}
    deployments.observe(await kube.apply(claim, force=False, field_manager=manager))


async def release(
    kube: Kube,
    deployments: ObjectCache,
    applied: Mapping[str, Any],
    mode: str,
    guard: Callable[[], None],
) -> Mapping[str, Any]:
    """After the operator applied a pool's Deployment (`applied`: the answer): the Baton
    managers that no longer own the count let go of it. The newest answer."""
    latest = applied
    for manager in releasable(mode, replicas_managers(applied)):
        guard()
        latest = await kube.apply(_identity(applied), field_manager=manager)
        deployments.observe(latest)
    return latest
