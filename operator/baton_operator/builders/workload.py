"""The Deployment and pod skeleton the engine pools and the router share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from baton_engine import contract
from baton_operator import models
from baton_operator.builders.common import (
    BuildContext,
    Manifest,
    labels,
    metadata,
    placement,
    pod_security_context,
    quantity,
)


def container_resources(
    cpu: int | str | None, memory: int | str | None, limits: Mapping[str, str] | None = None
) -> Manifest:
    """A CPU request, memory as both request and limit, and any other `limits`, only where set."""
    requests: dict[str, str] = {}
    limited: dict[str, str] = {}
    if cpu is not None:
        requests["cpu"] = quantity(cpu)
    if memory is not None:
        requests["memory"] = limited["memory"] = quantity(memory)
    limited.update(limits or {})
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limited:
        out["limits"] = limited
    return out


def pod_spec(
    placed: models.Placement,
    container: Manifest,
    volumes: list[Manifest],
    init_containers: list[Manifest],
    termination_grace_s: int,
    service_account: str | None = None,
) -> Manifest:
    """The restricted pod of one container; an API token is mounted only with `service_account`."""
    spec: Manifest = {}
    if service_account is not None:
        spec["serviceAccountName"] = service_account
    spec |= {
        "automountServiceAccountToken": service_account is not None,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_s,
        **placement(placed),
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    return spec


def deployment(
    ctx: BuildContext,
    name: str,
    component: str,
    pod: Manifest,
    rolling_update: Mapping[str, int],
    replicas: int | None,
    pod_labels: Mapping[str, str] | None = None,
    pod_annotations: Mapping[str, str] | None = None,
    **spec_fields: Any,
) -> Manifest:
    """A Deployment of `pod` selected by Baton's labels; `replicas` None leaves them out (another
    field manager owns them); `pod_labels` and `pod_annotations` go on the pods only;
    `spec_fields` are further DeploymentSpec fields."""
    container = pod["containers"][0]["name"]
    spec: Manifest = {} if replicas is None else {"replicas": replicas}
    spec |= {
        "selector": {"matchLabels": contract.pod_selector(ctx.owner.name, component)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(rolling_update)},
        "revisionHistoryLimit": 3,
        **spec_fields,
        "template": {
            "metadata": {
                "labels": {**labels(ctx.owner, component), **(pod_labels or {})},
                "annotations": {
                    "kubectl.kubernetes.io/default-container": container,
                    **(pod_annotations or {}),
                },
            },
            "spec": pod,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx.owner, name, component),
        "spec": spec,
    }
