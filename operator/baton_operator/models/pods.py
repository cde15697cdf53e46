"""Where and how big pods are: resources, scheduling constraints, roles and the router."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationInfo, field_validator

from baton_engine import contract
from baton_operator.models.base import CrdModel, cel, object_default, validations
from baton_operator.models.engine import EngineOverrides

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
#: A Kubernetes quantity ("500m", "16Gi", 4). Rendered as `x-kubernetes-int-or-string`.
Quantity = int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)]
RESOURCE_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$"
LABEL_MAP_EXTRA: dict[str, Any] = {"maxProperties": 64}


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
        pattern=RESOURCE_NAME_PATTERN,
        description="Extended resource name of the accelerator, e.g. amd.com/gpu or nvidia.com/gpu.",
    )
    cpu: Quantity | None = _quantity(None, "CPU request, e.g. 4 or 500m.")
    memory: Quantity | None = _quantity(None, "Memory request and limit, e.g. 32Gi.")


class RouterResources(CrdModel):
    """CPU and memory of one router pod (memory is both request and limit)."""

    cpu: Quantity | None = _quantity("500m", "CPU request.")
    memory: Quantity | None = _quantity("1Gi", "Memory request and limit.")


class Toleration(CrdModel):
    """A pod toleration (the core/v1 Toleration fields)."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                "self.operator != 'Exists' || !has(self.value)",
                "tolerations[].value must be empty when operator is Exists",
                ".value",
            )
        )
    }

    key: str | None = Field(None, max_length=316, description="Taint key; empty with Exists tolerates all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value (Equal only).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(None, description="How long a NoExecute taint is tolerated.")

    @field_validator("value")
    @classmethod
    def _value(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("operator") == "Exists" and value is not None:
            raise ValueError("tolerations[].value must be empty when operator is Exists")
        return value


class Placement(CrdModel):
    """Scheduling constraints shared by engine roles and the router."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods require.", json_schema_extra=LABEL_MAP_EXTRA
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(
        None,
        description="Pod affinity (core/v1 Affinity), passed through unchanged.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the pods.")


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
        "ghcr.io/baton-llm/baton-router:0.1.0", min_length=1, max_length=512, description="Router image."
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
