"""Pure functions from an InferenceDeployment to the manifests of its children."""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine import contract
from baton_operator.builders.common import BuildContext, Manifest, Owner
from baton_operator.builders.engine import engine_deployment, engine_service
from baton_operator.builders.extras import PODMONITOR_CRD, pod_monitor, signing_key_secret
from baton_operator.builders.inference_pool import INFERENCE_POOL_CRD, inference_pool
from baton_operator.builders.policy import disruption_budget, engine_network_policy
from baton_operator.builders.router import (
    router_deployment,
    router_endpoint,
    router_role,
    router_role_binding,
    router_service,
    router_service_account,
)


@dataclass(frozen=True)
class Children:
    """Everything one InferenceDeployment should own, grouped by how it is written."""

    applied: list[Manifest]  # server-side apply, forced, every reconcile
    created_once: list[Manifest]  # create; an existing one is left alone (the signing key)
    optional: list[tuple[str, Manifest]]  # (required CRD, manifest): applied only if the CRD exists
    removed: list[tuple[str, str, str]]  # (apiVersion, kind, name) no longer wanted: deleted


def desired_children(ctx: BuildContext, signing_key: str) -> Children:
    """Children in apply order: identities and RBAC first, workloads last."""
    roles = list(ctx.spec.roles())
    applied: list[Manifest] = [
        router_service_account(ctx),
        router_role(ctx),
        router_role_binding(ctx),
        *(engine_service(ctx, role) for role in roles),
        router_service(ctx),
        *(disruption_budget(ctx, role) for role in roles),
        disruption_budget(ctx, contract.ROLE_ROUTER),
    ]
    removed: list[tuple[str, str, str]] = []
    policy = engine_network_policy(ctx)
    if ctx.spec.network_policy.enabled:
        applied.append(policy)
    else:
        removed.append((policy["apiVersion"], policy["kind"], policy["metadata"]["name"]))
    applied += [*(engine_deployment(ctx, role) for role in roles), router_deployment(ctx)]
    optional = [(PODMONITOR_CRD, pod_monitor(ctx))]
    pool = inference_pool(ctx)
    if ctx.spec.inference_pool.enabled:
        optional.append((INFERENCE_POOL_CRD, pool))
    else:
        removed.append((pool["apiVersion"], pool["kind"], pool["metadata"]["name"]))
    return Children(
        applied=applied,
        created_once=[signing_key_secret(ctx, signing_key)],
        optional=optional,
        removed=removed,
    )


__all__ = [
    "BuildContext",
    "Children",
    "Manifest",
    "Owner",
    "desired_children",
    "router_endpoint",
]
