"""`spec.autoscaling`: who owns the role Deployments' replicas, and the built-in policy's knobs.

The policy itself lives in `baton_operator.autoscaler`; these are only its inputs. In aggregated
mode the single pool scales with the `decode` bounds and target.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from baton_operator.models.base import CrdModel, cel, object_default, validations

AutoscalingMode = Literal["builtin", "external", "off"]
METRICS_SOURCE_PATTERN = r"^(pods|https?://[^\s]+)$"


def _bounds_rule(role: str) -> dict[str, str]:
    return cel(
        "self.minReplicas <= self.maxReplicas",
        f"spec.autoscaling.{role}.minReplicas must be <= spec.autoscaling.{role}.maxReplicas",
        ".minReplicas",
        "FieldValueInvalid",
    )


def _check_bounds(role: str, min_replicas: int, max_replicas: int) -> None:
    if min_replicas > max_replicas:
        raise ValueError(
            f"spec.autoscaling.{role}.minReplicas must be <= spec.autoscaling.{role}.maxReplicas"
        )


class PrefillScaling(CrdModel):
    """Prefill pool bounds; it scales on queue depth (requests waiting per pod)."""

    model_config = {"json_schema_extra": validations(_bounds_rule("prefill"))}

    min_replicas: int = Field(
        1,
        ge=0,
        le=1024,
        description="Fewest prefill pods; 0 (builtin mode, with decode's 0 too) scales both pools to zero "
        "after scaleToZeroIdleSeconds without a request.",
    )
    max_replicas: int = Field(4, ge=1, le=1024, description="Most prefill pods.")
    target_queue_depth: float = Field(
        4.0, gt=0.0, le=100000.0, description="Requests waiting per prefill pod the policy aims for."
    )

    @model_validator(mode="after")
    def _bounds(self) -> PrefillScaling:
        _check_bounds("prefill", self.min_replicas, self.max_replicas)
        return self


class DecodeScaling(CrdModel):
    """Decode pool bounds; it scales on KV-cache usage (0..1, mean over pods)."""

    model_config = {"json_schema_extra": validations(_bounds_rule("decode"))}

    min_replicas: int = Field(
        1,
        ge=0,
        le=1024,
        description="Fewest decode pods (of the pool in aggregated mode); 0 (builtin mode) scales to zero "
        "after scaleToZeroIdleSeconds without a request.",
    )
    max_replicas: int = Field(4, ge=1, le=1024, description="Most decode pods.")
    target_kv_usage: float = Field(
        0.7,
        gt=0.0,
        le=1.0,
        alias="targetKVUsage",
        description="KV-cache usage ratio per decode pod the policy aims for, in (0, 1].",
    )

    @model_validator(mode="after")
    def _bounds(self) -> DecodeScaling:
        _check_bounds("decode", self.min_replicas, self.max_replicas)
        return self


class ScaleUp(CrdModel):
    """How fast pools grow."""

    stabilization_window_seconds: int = Field(
        0, ge=0, le=3600, description="Scale up to the lowest recommendation of this window."
    )
    max_step: int = Field(2, ge=1, le=1024, description="Most pods added in one decision.")


class ScaleDown(CrdModel):
    """How fast pools shrink."""

    stabilization_window_seconds: int = Field(
        300, ge=0, le=3600, description="Scale down to the highest recommendation of this window."
    )
    max_step: int = Field(1, ge=1, le=1024, description="Most pods removed in one decision.")


class AutoscalingSpec(CrdModel):
    """Replica ownership: builtin (Baton's policy), external (HPA/KEDA) or off (spec.<role>.replicas)."""

    mode: AutoscalingMode = Field(
        "off",
        description="builtin: Baton's policy sets replicas; external: HPA/KEDA own them and Baton never "
        "writes them; off: the operator applies spec.<role>.replicas.",
    )
    interval_seconds: int = Field(15, ge=1, le=3600, description="Seconds between two policy decisions.")
    scale_to_zero_idle_seconds: int = Field(
        300,
        ge=1,
        le=86400,
        alias="scaleToZeroIdleSeconds",
        description="With minReplicas 0: seconds without a request (none arriving at the router, held or "
        "running) before every pool scales to zero; a request held by the router wakes them at once.",
    )
    metrics_source: str = Field(
        "pods",
        max_length=2048,
        pattern=METRICS_SOURCE_PATTERN,
        description="Where engine metrics come from: 'pods' (scrape each pod's /metrics) or a Prometheus "
        "base URL (http:// or https://).",
    )
    prefill: PrefillScaling = Field(
        default_factory=PrefillScaling,
        description="Prefill bounds.",
        json_schema_extra=object_default(PrefillScaling),
    )
    decode: DecodeScaling = Field(
        default_factory=DecodeScaling,
        description="Decode bounds.",
        json_schema_extra=object_default(DecodeScaling),
    )
    scale_up: ScaleUp = Field(
        default_factory=ScaleUp, description="Scale-up behaviour.", json_schema_extra=object_default(ScaleUp)
    )
    scale_down: ScaleDown = Field(
        default_factory=ScaleDown,
        description="Scale-down behaviour.",
        json_schema_extra=object_default(ScaleDown),
    )
