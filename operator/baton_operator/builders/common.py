"""What every child shares: names, labels, owner references, the restricted security context."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from baton_engine import contract
from baton_operator import models
from baton_operator.models import InferenceDeploymentSpec

Manifest = dict[str, Any]

#: UID/GID the images run as (see images/*/Dockerfile); numeric so runAsNonRoot can be verified.
RUN_AS_USER = 10001
OPERATOR_COMPONENT = "operator"


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment that owns (and garbage-collects) every child."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class PoolOverride:
    """What a rollout pass sets on one pool's Deployment (see `baton_operator.rollout`)."""

    paused: bool = False  # the Deployment controller must not act on the new template yet
    replicas: int | None = None  # autoscaling off: this step's replicas instead of the spec's


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder reads: the resource, its parsed spec, and operator-level settings."""

    owner: Owner
    spec: InferenceDeploymentSpec
    operator_namespace: str = ""  # allowed through the engines' NetworkPolicy (metrics scraping)
    monitoring_namespace: str = ""  # likewise, e.g. where Prometheus runs
    pools: Mapping[str, PoolOverride] = field(default_factory=dict)  # role -> a rollout's override

    @property
    def replicas_owned(self) -> bool:
        """Whether the operator applies the role Deployments' replicas (autoscaling off)."""
        return self.spec.autoscaling.mode == "off"


def child_name(owner: Owner, component: str) -> str:
    return f"{owner.name}-{component}"


def secret_name(owner: Owner) -> str:
    return f"{owner.name}-kv-transfer"


def labels(owner: Owner, component: str) -> dict[str, str]:
    """Standard app.kubernetes.io labels plus Baton's selector labels."""
    return {
        contract.LABEL_NAME: contract.APP_NAME,
        contract.LABEL_INSTANCE: owner.name,
        contract.LABEL_COMPONENT: component,
        contract.LABEL_PART_OF: contract.APP_NAME,
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY,
        **contract.pod_selector(owner.name, component),
    }


def owner_reference(owner: Owner) -> Manifest:
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(owner: Owner, name: str, component: str) -> Manifest:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [owner_reference(owner)],
    }


def pod_security_context() -> Manifest:
    """PodSecurity 'restricted' at the pod level; fsGroup lets the user read mounted volumes."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_identity_env() -> list[Manifest]:
    """The pod's own address, name and namespace from the downward API."""

    def field(name: str, path: str) -> Manifest:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        field(contract.ENV_POD_IP, "status.podIP"),
        field(contract.ENV_POD_NAME, "metadata.name"),
        field(contract.ENV_POD_NAMESPACE, "metadata.namespace"),
    ]


def placement(spec: models.Placement) -> Manifest:
    """nodeSelector, tolerations, affinity and priority class, only where set."""
    out: Manifest = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.affinity is not None:
        out["affinity"] = spec.affinity.model_dump(by_alias=True, exclude_defaults=True)
    if spec.priority_class_name:
        out["priorityClassName"] = spec.priority_class_name
    return out


def http_probe(path: str, period: int, failures: int, timeout: int = 3) -> Manifest:
    return {
        "httpGet": {"path": path, "port": contract.PORT_HTTP},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def quantity(value: int | str) -> str:
    return str(value)
