"""Pydantic models of the InferenceDeployment resource; the CRD schema is generated from them."""

from baton_operator.models.autoscaling import (
    AutoscalingSpec,
    DecodeScaling,
    PrefillScaling,
    ScaleDown,
    ScaleUp,
)
from baton_operator.models.engine import EngineOverrides, EngineSpec, EnvVar
from baton_operator.models.inference_pool import EndpointPickerSpec, InferencePoolSettings
from baton_operator.models.pods import Resources, RoleSpec, RouterSpec, ServiceSpec
from baton_operator.models.scheduling import Affinity, Placement, Toleration
from baton_operator.models.source import ModelSource, parse_source
from baton_operator.models.spec import (
    InferenceDeploymentSpec,
    KVEventsSpec,
    KVTransferSpec,
    ModelSpec,
    NetworkPolicySpec,
    SecretKeyRef,
)
from baton_operator.models.status import AutoscalingStatus, Condition, InferenceDeploymentStatus, RoleStatus

GROUP = "baton.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)
API_VERSION = f"{GROUP}/{VERSION}"

__all__ = [
    "API_VERSION",
    "Affinity",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "Condition",
    "DecodeScaling",
    "EndpointPickerSpec",
    "EngineOverrides",
    "EngineSpec",
    "EnvVar",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "InferencePoolSettings",
    "KVEventsSpec",
    "KVTransferSpec",
    "ModelSource",
    "ModelSpec",
    "NetworkPolicySpec",
    "Placement",
    "PrefillScaling",
    "Resources",
    "RoleSpec",
    "RoleStatus",
    "RouterSpec",
    "ScaleDown",
    "ScaleUp",
    "SecretKeyRef",
    "ServiceSpec",
    "Toleration",
    "parse_source",
]
