"""How big pods are and what they run: resources, the engine roles and the router (where they
run: `scheduling`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

from baton_engine import contract
from baton_operator.models.base import CrdModel, cel, object_default, validations
from baton_operator.models.engine import IMAGE_PATTERN, EngineOverrides
from baton_operator.models.scheduling import DNS_SUBDOMAIN, Placement

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
#: A Kubernetes quantity ("500m", "16Gi", 4). Rendered as `x-kubernetes-int-or-string`.
Quantity = int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)]
#: An extended resource name: a domain, '/', and a name (what a device plugin advertises). Names
#: without a domain (cpu, memory, gpu) and those in the kubernetes.io domains are not extended.
EXTENDED_RESOURCE_PATTERN = rf"^{DNS_SUBDOMAIN}/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
NATIVE_DOMAIN = r"^([^/]*[.])?kubernetes[.]io/"


def _quantity(default: Quantity | None, description: str) -> Any:
    return Field(
        default,
        description=description,
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN},
    )


class Resources(CrdModel):
    """Accelerators, CPU and memory of one pod (memory is both request and limit)."""

    gpus: int = Field(1, ge=0, le=64, description="Accelerators per pod (0 runs on CPU).")
    gpu_resource: str = Field(
        "amd.com/gpu",
        max_length=253,
        pattern=EXTENDED_RESOURCE_PATTERN,
        description="Extended resource name of the accelerator (DOMAIN/NAME, not in kubernetes.io), e.g. "
        "amd.com/gpu or nvidia.com/gpu.",
        json_schema_extra=validations(
            cel(
                f"!self.matches('{NATIVE_DOMAIN}') && !self.startsWith('requests.')",
                "must be an extended resource name: not in the kubernetes.io domains, not starting with "
                "'requests.'",
            )
        ),
    )
    cpu: Quantity | None = _quantity(None, "CPU request, e.g. 4 or 500m.")
    memory: Quantity | None = _quantity(None, "Memory request and limit, e.g. 32Gi.")

    @field_validator("gpu_resource")
    @classmethod
    def _extended(cls, name: str) -> str:
        if re.match(NATIVE_DOMAIN, name) or name.startswith("requests."):
            raise ValueError(
                "must be an extended resource name: not in the kubernetes.io domains, not starting with "
                "'requests.'"
            )
        return name


class RouterResources(CrdModel):
    """CPU and memory of one router pod (memory is both request and limit)."""

    cpu: Quantity | None = _quantity("500m", "CPU request.")
    memory: Quantity | None = _quantity("1Gi", "Memory request and limit.")


class RoleSpec(Placement):
    """One engine pool (prefill, decode, or the single pool of aggregated mode)."""

    replicas: int = Field(
        1, ge=0, le=1024, description="Pods of this role; used only when spec.autoscaling.mode is off."
    )
    engine: EngineOverrides | None = Field(None, description="Engine settings overriding spec.engine.")
    resources: Resources = Field(
        default_factory=Resources,
        description="Per-pod resources.",
        json_schema_extra=object_default(Resources),
    )
    startup_timeout_seconds: int = Field(
        900,
        ge=10,
        le=86400,
        description="How long a pod may take to load its model before it is restarted.",
    )
    termination_grace_period_seconds: int = Field(
        60, ge=0, le=3600, description="Time to drain in-flight requests after SIGTERM."
    )


class ServiceSpec(CrdModel):
    """The router's Service: the deployment's OpenAI-compatible endpoint."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: int = Field(80, ge=1, le=65535, description="Service port.")


class RouterSpec(Placement):
    """The router: an OpenAI-compatible proxy sending each request through prefill then decode."""

    replicas: int = Field(1, ge=0, le=64, description="Router pods.")
    image: str = Field(
        "ghcr.io/baton-llm/baton-router:0.1.0",
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Router image.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the router container."
    )
    port: int = Field(
        contract.DEFAULT_ROUTER_PORT, ge=1, le=65535, description="Router container port (named 'http')."
    )
    service: ServiceSpec = Field(
        default_factory=ServiceSpec,
        description="The router's Service.",
        json_schema_extra=object_default(ServiceSpec),
    )
    resources: RouterResources = Field(
        default_factory=RouterResources,
        description="Per-pod resources.",
        json_schema_extra=object_default(RouterResources),
    )
    hold_queue: int = Field(
        64,
        ge=0,
        le=100000,
        description="Requests a router pod holds at most while a pool they need has no ready pod (scaled "
        "to zero, starting); beyond it, 503 with Retry-After (0: 503 at once).",
    )
    hold_timeout_seconds: int = Field(
        120,
        ge=1,
        le=3600,
        description="Longest a request is held for a pod before it gets 503 with Retry-After (a cold "
        "start must fit in it).",
    )
