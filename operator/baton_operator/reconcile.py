"""One level-based reconcile of an InferenceDeployment: build children, apply, read back, status.

Kopf-free, so the same code runs from handlers, from tests and from the benchmark.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from baton_engine import contract
from baton_operator.builders import BuildContext, Owner, desired_children, router_endpoint
from baton_operator.builders.common import child_name
from baton_operator.builders.extras import new_signing_key
from baton_operator.kube import Kube, KubeError
from baton_operator.models import InferenceDeploymentSpec
from baton_operator.status import Observed, compute_status


@dataclass(frozen=True)
class OperatorConfig:
    operator_namespace: str = ""
    monitoring_namespace: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    applied: int = 0
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


class InvalidSpec(ValueError):
    """The stored spec fails the models (the CRD should have refused it): not retried."""


#: Called before each child write with its index; tests use it to stop a reconcile part-way.
BeforeWrite = Callable[[int, Mapping[str, Any]], Awaitable[None]]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_of(body: Mapping[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def parse_spec(body: Mapping[str, Any]) -> InferenceDeploymentSpec:
    try:
        return InferenceDeploymentSpec.model_validate(body.get("spec", {}))
    except ValidationError as exc:
        raise InvalidSpec(f"spec is invalid: {exc}") from exc


async def _no_hook(index: int, manifest: Mapping[str, Any]) -> None:
    return None


async def reconcile(
    kube: Kube, body: Mapping[str, Any], cfg: OperatorConfig, before_write: BeforeWrite = _no_hook
) -> Outcome:
    """Bring the children to the spec, then report status. Raises on API errors (status first)."""
    owner = owner_of(body)
    ctx = BuildContext(owner, parse_spec(body), cfg.operator_namespace, cfg.monitoring_namespace)
    children = desired_children(ctx, new_signing_key())
    outcome = Outcome()
    index = 0
    try:
        for manifest in children.created_once:
            await before_write(index, manifest)
            index += 1
            if await kube.create_if_absent(manifest):
                outcome.events.append(
                    Event("Normal", "SigningKeyCreated", f"created Secret {manifest['metadata']['name']}")
                )
        applied_deployments: dict[str, dict[str, Any]] = {}
        for manifest in children.applied:
            await before_write(index, manifest)
            index += 1
            result = await kube.apply(manifest)
            outcome.applied += 1
            if manifest["kind"] == "Deployment":
                applied_deployments[manifest["metadata"]["name"]] = result
        for crd_name, manifest in children.optional:
            if await kube.crd_exists(crd_name):
                await kube.apply(manifest)
                outcome.applied += 1
        for api_version, kind, name in children.removed:
            if await kube.delete_if_present(api_version, kind, owner.namespace, name):
                outcome.events.append(Event("Normal", "ChildRemoved", f"deleted {kind} {name}"))
    except Exception as exc:
        # Report Degraded if the API still answers; the original error is what propagates.
        with contextlib.suppress(KubeError):
            outcome.status = await refresh_status(kube, body, ctx.spec, error=f"{type(exc).__name__}: {exc}")
        raise
    outcome.status = await refresh_status(kube, body, ctx.spec, known=applied_deployments)
    return outcome


async def refresh_status(
    kube: Kube,
    body: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    error: str | None = None,
    known: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Patch the status subresource from the child Deployments; returns the patch. `known`
    holds Deployments an apply just returned (name -> object): those are not read again."""
    owner = owner_of(body)
    deployments: dict[str, Mapping[str, Any] | None] = {}
    for role in [*spec.roles(), contract.ROLE_ROUTER]:
        name = child_name(owner, role)
        if known is not None and name in known:
            deployments[role] = known[name]
        else:
            deployments[role] = await kube.get("apps/v1", "Deployment", owner.namespace, name)
    ctx = BuildContext(owner, spec)
    patch = compute_status(
        name=owner.name,
        generation=int(body["metadata"].get("generation", 0)),
        observed=Observed(deployments=deployments, error=error),
        endpoint=router_endpoint(ctx),
        now=now_rfc3339(),
        previous=body.get("status") or {},
    )
    await kube.patch_status(owner.namespace, owner.name, patch)
    return patch
