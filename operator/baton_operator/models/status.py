"""`InferenceDeployment.status`: what the operator observed, in Kubernetes' conventional shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from baton_operator.models.base import CrdModel

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(CrdModel):
    """A metav1.Condition."""

    type: str = Field(max_length=316, description="Condition type: Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(None, ge=0, description="Generation the condition is about.")
    last_transition_time: str = Field(
        description="When status last changed.", json_schema_extra={"format": "date-time"}
    )
    reason: str = Field(max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field("", max_length=32768, description="Human-readable details.")


class RoleStatus(CrdModel):
    """Replica counts of one pool, read from its Deployment."""

    replicas: int = Field(0, ge=0, description="Pods that exist.")
    ready_replicas: int = Field(0, ge=0, description="Pods that are Ready.")
    desired_replicas: int = Field(0, ge=0, description="Pods wanted (the Deployment's spec.replicas).")
    ready: str = Field("0/0", description="readyReplicas/desiredReplicas, for printing.")
    selector: str = Field("", description="Label selector of the pool's pods.")
    kv_compat_key: str | None = Field(
        None,
        max_length=63,
        alias="kvCompatKey",
        description="The KV-compatibility key the pool's pods must have (label baton.dev/kv-compat).",
    )
    new_key_pods: int | None = Field(
        None, ge=0, description="Pods of that key (not terminating); during a rollout, the new generation."
    )
    old_key_pods: int | None = Field(
        None,
        ge=0,
        description="Pods of another key that still exist (the old generation, draining ones too).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks (GPUs) each pod of the pool splits the model across."
    )


class AutoscalingStatus(CrdModel):
    """The built-in autoscaler's latest decision."""

    last_decision: dict[str, int] = Field(
        default_factory=dict, description="Role -> replicas the last decision asked for."
    )
    reason: str = Field("", max_length=4096, description="Why, in words.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Metrics the decision saw.")
    time: str | None = Field(
        None, description="When the decision was made.", json_schema_extra={"format": "date-time"}
    )
    current_replicas: dict[str, int] = Field(
        default_factory=dict, description="Role -> replicas when the decision was made."
    )
    action: str | None = Field(None, max_length=16, description="up, down or hold (the decision as a whole).")
    scraped_at: str | None = Field(
        None,
        description="When the newest engine /metrics answer the decision used came.",
        json_schema_extra={"format": "date-time"},
    )
    history: str | None = Field(
        None,
        max_length=262144,
        description="Recent recommendations and scale actions (JSON), so a restarted operator keeps "
        "its stabilization windows.",
    )


class InferenceDeploymentStatus(CrdModel):
    """Observed state."""

    observed_generation: int | None = Field(None, ge=0, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing and Degraded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    prefill: RoleStatus | None = Field(None, description="Prefill pool.")
    decode: RoleStatus | None = Field(None, description="Decode pool.")
    pool: RoleStatus | None = Field(None, description="The aggregated pool.")
    router: RoleStatus | None = Field(None, description="Router pods.")
    endpoint: str | None = Field(None, description="The router's in-cluster URL.")
    autoscaling: AutoscalingStatus | None = Field(None, description="The autoscaler's latest decision.")
