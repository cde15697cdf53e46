"""A valid InferenceDeployment, the children it gets, and invalid ones; shared by the pydantic
tests, the builder tests and the real API-server tests.

Each case patches a valid resource; `field` is the path the API server must name, `detail` a
fragment of its message. The pydantic models must refuse the same spec and name the same field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

DELETE = object()

VALID_SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
}

#: (kind, name) of the applied children of VALID_SPEC named `demo`, in apply order (the signing
#: key Secret is created apart; the PodMonitor only where its CRD exists).
DEMO_APPLIED_CHILDREN: list[tuple[str, str]] = [
    ("ServiceAccount", "demo-router"),
    ("Role", "demo-router"),
    ("RoleBinding", "demo-router"),
    ("Service", "demo-prefill"),
    ("Service", "demo-decode"),
    ("Service", "demo-router"),
    ("PodDisruptionBudget", "demo-prefill"),
    ("PodDisruptionBudget", "demo-decode"),
    ("PodDisruptionBudget", "demo-router"),
    ("NetworkPolicy", "demo-engines"),
    ("Deployment", "demo-prefill"),
    ("Deployment", "demo-decode"),
    ("Deployment", "demo-router"),
]


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep merge; DELETE removes a key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass(frozen=True)
class Case:
    id: str
    spec_patch: dict[str, Any]
    field: str
    detail: str
    name: str = "bad"  # metadata.name

    def spec(self) -> dict[str, Any]:
        return merged(VALID_SPEC, self.spec_patch)

    def pydantic_fragment(self) -> str:
        return self.field.removeprefix("spec.").replace("[0]", ".0")


AGGREGATED = {"mode": "aggregated"}
SPEC_CASES: list[Case] = [
    Case("source-scheme", {"model": {"source": "s3://bucket/m"}}, "spec.model.source", "should match"),
    Case("pvc-parent-dir", {"model": {"source": "pvc://models/../etc"}}, "spec.model.source", "'..'"),
    Case("model-name-missing", {"model": {"name": DELETE}}, "spec.model.name", "Required value"),
    Case("mode-unknown", {"mode": "hybrid"}, "spec.mode", "Unsupported value"),
    Case(
        "block-size-zero", {"engine": {"blockSize": 0}}, "spec.engine.blockSize", "greater than or equal to 1"
    ),
    Case(
        "budget-below-block",
        {"engine": {"maxNumBatchedTokens": 8}},
        "spec.engine.maxNumBatchedTokens",
        "spec.engine.maxNumBatchedTokens must be >= spec.engine.blockSize",
    ),
    Case(
        "budget-below-context-unchunked",
        {"engine": {"chunkedPrefill": False}},
        "spec.engine.maxNumBatchedTokens",
        "must be >= spec.engine.maxModelLen when chunkedPrefill is false",
    ),
    Case(
        "gpu-memory-utilization",
        {"engine": {"gpuMemoryUtilization": 1.5}},
        "spec.engine.gpuMemoryUtilization",
        "less than or equal to 1",
    ),
    Case("dtype-unknown", {"engine": {"dtype": "int4"}}, "spec.engine.dtype", "Unsupported value"),
    Case(
        "prefix-hash-unknown",
        {"engine": {"prefixHash": "md5"}},
        "spec.engine.prefixHash",
        "Unsupported value",
    ),
    Case(
        "replicas-negative",
        {"prefill": {"replicas": -1}},
        "spec.prefill.replicas",
        "greater than or equal to 0",
    ),
    Case(
        "port-range", {"kvTransfer": {"port": 70000}}, "spec.kvTransfer.port", "less than or equal to 65535"
    ),
    Case(
        "events-port-clash",
        {"kvEvents": {"port": 5600}},
        "spec.kvEvents.port",
        "spec.kvEvents.port must differ from spec.kvTransfer.port",
    ),
    Case(
        "http-port-clash",
        {"engine": {"port": 5600}},
        "spec.kvTransfer.port",
        "spec.kvTransfer.port must differ from spec.engine.port",
    ),
    Case(
        "replay-port-clash",
        {"kvEvents": {"replayPort": 5557}},
        "spec.kvEvents.replayPort",
        "spec.kvEvents.replayPort must differ from spec.kvEvents.port",
    ),
    Case(
        "on-failure-unknown",
        {"kvTransfer": {"onFailure": "retry"}},
        "spec.kvTransfer.onFailure",
        "Unsupported",
    ),
    Case(
        "lease-zero",
        {"kvTransfer": {"leaseSeconds": 0}},
        "spec.kvTransfer.leaseSeconds",
        "greater than or equal",
    ),
    Case("autoscaling-mode", {"autoscaling": {"mode": "auto"}}, "spec.autoscaling.mode", "Unsupported value"),
    Case(
        "prefill-min-above-max",
        {"autoscaling": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}},
        "spec.autoscaling.prefill.minReplicas",
        "spec.autoscaling.prefill.minReplicas must be <= spec.autoscaling.prefill.maxReplicas",
    ),
    Case(
        "decode-min-above-max",
        {"autoscaling": {"decode": {"minReplicas": 5}}},
        "spec.autoscaling.decode.minReplicas",
        "spec.autoscaling.decode.minReplicas must be <= spec.autoscaling.decode.maxReplicas",
    ),
    Case(
        "kv-usage-zero",
        {"autoscaling": {"decode": {"targetKVUsage": 0}}},
        "spec.autoscaling.decode.targetKVUsage",
        "greater than 0",
    ),
    Case(
        "kv-usage-above-one",
        {"autoscaling": {"decode": {"targetKVUsage": 1.5}}},
        "spec.autoscaling.decode.targetKVUsage",
        "less than or equal to 1",
    ),
    Case(
        "max-step-zero", {"autoscaling": {"scaleUp": {"maxStep": 0}}}, "spec.autoscaling.scaleUp.maxStep", "1"
    ),
    Case(
        "metrics-source",
        {"autoscaling": {"metricsSource": "ftp://prom"}},
        "spec.autoscaling.metricsSource",
        "should match",
    ),
    Case(
        "aggregated-with-prefill",
        {**AGGREGATED, "prefill": {"replicas": 1}},
        "spec.prefill",
        "spec.prefill must be empty when spec.mode is aggregated",
    ),
    Case(
        "aggregated-with-decode",
        {**AGGREGATED, "decode": {"replicas": 1}},
        "spec.decode",
        "spec.decode must be empty when spec.mode is aggregated",
    ),
    Case(
        "disaggregated-with-pool",
        {"pool": {"replicas": 1}},
        "spec.pool",
        "spec.pool must be empty when spec.mode is disaggregated",
    ),
    Case(
        "gpus-negative",
        {"prefill": {"resources": {"gpus": -1}}},
        "spec.prefill.resources.gpus",
        "greater than",
    ),
    Case(
        "gpu-resource-name",
        {"decode": {"resources": {"gpuResource": "not a resource!"}}},
        "spec.decode.resources.gpuResource",
        "should match",
    ),
    Case(
        "memory-quantity",
        {"decode": {"resources": {"memory": "lots"}}},
        "spec.decode.resources.memory",
        "match",
    ),
    Case(
        "hf-token-on-builtin",
        {"model": {"hfTokenSecret": {"name": "hf"}}},
        "spec.model.hfTokenSecret",
        "spec.model.hfTokenSecret is only allowed with an hf: source",
    ),
    Case(
        "override-budget-below-block",
        {"prefill": {"engine": {"maxNumBatchedTokens": 8}}},
        "spec.prefill.engine.maxNumBatchedTokens",
        "spec.prefill.engine.maxNumBatchedTokens must be >= spec.engine.blockSize",
    ),
    Case(
        "override-unchunked-budget",
        {"decode": {"engine": {"chunkedPrefill": False}}},
        "spec.decode.engine.maxNumBatchedTokens",
        "spec.decode.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill is "
        "false",
    ),
    Case(
        "override-shared-setting",
        {"prefill": {"engine": {"blockSize": 32}}},
        "spec.prefill.engine.blockSize",
        "unknown field",
    ),
    Case(
        "service-type",
        {"router": {"service": {"type": "Ingress"}}},
        "spec.router.service.type",
        "Unsupported value",
    ),
    Case(
        "toleration-exists-with-value",
        {"prefill": {"tolerations": [{"operator": "Exists", "value": "x"}]}},
        "spec.prefill.tolerations[0].value",
        "tolerations[].value must be empty when operator is Exists",
    ),
]

NAME_CASES: list[Case] = [
    Case("name-too-long", {}, "metadata.name", "at most 40 characters", name="a" * 41),
    Case("name-with-dot", {}, "metadata.name", "DNS-1035 label", name="web.v2"),
]
