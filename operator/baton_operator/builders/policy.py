"""Guard rails: the engines' NetworkPolicy and a PodDisruptionBudget per pool."""

from __future__ import annotations

from baton_engine import contract
from baton_operator.builders.common import OPERATOR_COMPONENT, BuildContext, Manifest, child_name, metadata

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
ENGINES_COMPONENT = "engines"


def engine_network_policy(ctx: BuildContext) -> Manifest:
    """Engine pods take traffic only from their own deployment's pods (router and peers), the
    operator's pods (metrics for the autoscaler) and the monitoring namespace."""
    peers: list[Manifest] = [{"podSelector": {"matchLabels": {contract.LABEL_DEPLOYMENT: ctx.owner.name}}}]
    if ctx.operator_namespace:
        peers.append(
            {
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ctx.operator_namespace}},
                "podSelector": {
                    "matchLabels": {
                        contract.LABEL_PART_OF: contract.APP_NAME,
                        contract.LABEL_COMPONENT: OPERATOR_COMPONENT,
                    }
                },
            }
        )
    if ctx.monitoring_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ctx.monitoring_namespace}}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ctx.owner, child_name(ctx.owner, ENGINES_COMPONENT), ENGINES_COMPONENT),
        "spec": {
            "podSelector": {
                "matchLabels": {contract.LABEL_DEPLOYMENT: ctx.owner.name},
                "matchExpressions": [
                    {"key": contract.LABEL_ROLE, "operator": "In", "values": sorted(ctx.spec.roles())}
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers}],
        },
    }


def disruption_budget(ctx: BuildContext, component: str) -> Manifest:
    """At most one pod of a pool voluntarily down; not-ready pods may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ctx.owner, child_name(ctx.owner, component), component),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": contract.pod_selector(ctx.owner.name, component)},
        },
    }
