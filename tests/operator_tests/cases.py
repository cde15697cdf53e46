"""A valid InferenceDeployment, the children it gets, and invalid ones; shared by the pydantic
tests, the builder tests and the real API-server tests.

Each case patches a valid resource; `field` is the path the API server must name, `detail` a
fragment of its message. The pydantic models must refuse the same spec and name the same field.
"""

from __future__ import annotations

import copy
import re
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
    pydantic_field: str | None = None  # where pydantic reports it, when not at `field`

    def spec(self) -> dict[str, Any]:
        return merged(VALID_SPEC, self.spec_patch)

    def pydantic_fragment(self) -> str:
        field = self.pydantic_field or self.field
        return re.sub(r"\[(\d+)\]", r".\1", field.removeprefix("spec."))


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
        "kv-cache-dtype-unknown",
        {"engine": {"kvCacheDtype": "int8"}},
        "spec.engine.kvCacheDtype",
        "Unsupported value",
    ),
    Case(
        "quantization-unknown",
        {"engine": {"quantization": "awq"}},
        "spec.engine.quantization",
        "Unsupported value",
    ),
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
        "only-prefill-to-zero",
        {"autoscaling": {"mode": "builtin", "prefill": {"minReplicas": 0}}},
        "spec.autoscaling.decode.minReplicas",
        "spec.autoscaling.prefill.minReplicas and spec.autoscaling.decode.minReplicas must be 0 together",
        pydantic_field="spec",
    ),
    Case(
        "min-replicas-negative",
        {"autoscaling": {"decode": {"minReplicas": -1}}},
        "spec.autoscaling.decode.minReplicas",
        "greater than or equal to 0",
    ),
    Case(
        "idle-seconds-zero",
        {"autoscaling": {"scaleToZeroIdleSeconds": 0}},
        "spec.autoscaling.scaleToZeroIdleSeconds",
        "greater than or equal to 1",
    ),
    Case(
        "hold-queue-negative",
        {"router": {"holdQueue": -1}},
        "spec.router.holdQueue",
        "greater than or equal to 0",
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
        "tp-over-role-gpus",
        {"prefill": {"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 4}}},
        "spec.prefill.engine.tensorParallelSize",
        "spec.prefill.engine.tensorParallelSize must be <= spec.prefill.resources.gpus (one GPU per rank)",
    ),
    Case(
        "tp-top-level-over-a-default-role",
        {"engine": {"tensorParallelSize": 2}, "prefill": {"resources": {"gpus": 2}}},
        "spec.decode.engine.tensorParallelSize",
        "spec.decode.engine.tensorParallelSize must be <= spec.decode.resources.gpus (one GPU per rank)",
    ),
    Case(
        "tp-over-pool-gpus",
        {"mode": "aggregated", "pool": {"engine": {"tensorParallelSize": 2}}},
        "spec.pool.engine.tensorParallelSize",
        "spec.pool.engine.tensorParallelSize must be <= spec.pool.resources.gpus (one GPU per rank)",
    ),
    # A TP producer's ranks serve KV on kvTransfer.port + rank: the range holds no other port.
    Case(
        "tp-kv-range-over-events-port-by-one",
        {"prefill": {"resources": {"gpus": 2}}, "kvTransfer": {"port": 5556}},  # 5556..5557
        "spec.kvEvents.port",
        "spec.kvEvents.port must be outside spec.kvTransfer.port .. spec.kvTransfer.port + "
        "spec.prefill.engine.tensorParallelSize - 1 (the prefill pods' ranks serve KV on one port each)",
    ),
    Case(
        "tp-kv-range-over-replay-port",
        {
            "prefill": {"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}},
            "kvEvents": {"replayPort": 5601},
        },
        "spec.kvEvents.replayPort",
        "spec.kvEvents.replayPort must be outside spec.kvTransfer.port .. spec.kvTransfer.port + "
        "spec.prefill.engine.tensorParallelSize - 1",
    ),
    Case(
        "tp-kv-range-over-http-port",
        {"engine": {"port": 5603}, "prefill": {"resources": {"gpus": 4}}},  # 5600..5603
        "spec.engine.port",
        "spec.engine.port must be outside spec.kvTransfer.port .. spec.kvTransfer.port + "
        "spec.prefill.engine.tensorParallelSize - 1",
    ),
    Case(
        "tp-kv-range-of-a-cpu-pool",
        {
            **AGGREGATED,
            "engine": {"tensorParallelSize": 3},
            "pool": {"resources": {"gpus": 0}},
            "kvEvents": {"port": 5602},
        },
        "spec.kvEvents.port",
        "spec.kvEvents.port must be outside spec.kvTransfer.port .. spec.kvTransfer.port + "
        "spec.pool.engine.tensorParallelSize - 1 (the pool pods' ranks serve KV on one port each)",
    ),
    Case(
        "tp-kv-range-past-65535",
        {"prefill": {"resources": {"gpus": 2}}, "kvTransfer": {"port": 65535}},
        "spec.kvTransfer.port",
        "spec.kvTransfer.port .. spec.kvTransfer.port + spec.prefill.engine.tensorParallelSize - 1 must end "
        "at or below 65535",
    ),
    Case(
        "tp-above-64",
        {"engine": {"tensorParallelSize": 65}},
        "spec.engine.tensorParallelSize",
        "less than or equal to 64",
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

LONG_NAME = "n" * 64  # one past a label name's 63 characters
#: Specs the CRD used to accept and the child objects refused (the API server's pod and container
#: validation), now refused by the CRD itself, naming the field.
CHILD_REFUSED_CASES: list[Case] = [
    Case(
        "node-selector-key-space",
        {"prefill": {"nodeSelector": {"gpu type": "mi300x"}}},
        "spec.prefill.nodeSelector",
        "keys must be label keys",
    ),
    Case(
        "node-selector-key-64",
        {"decode": {"nodeSelector": {LONG_NAME: "x"}}},
        "spec.decode.nodeSelector",
        "keys must be label keys",
    ),
    Case(
        "node-selector-key-bad-prefix",
        {"router": {"nodeSelector": {"Example.COM/zone": "a"}}},
        "spec.router.nodeSelector",
        "keys must be label keys",
    ),
    Case(
        "node-selector-value-space",
        {"prefill": {"nodeSelector": {"zone": "us east"}}},
        "spec.prefill.nodeSelector.zone",
        "should match",
    ),
    Case(
        "node-selector-value-64",
        {"decode": {"nodeSelector": {"zone": "v" * 64}}},
        "spec.decode.nodeSelector.zone",
        "may not be more than 63",
    ),
    Case(
        "toleration-seconds-noschedule",
        {"prefill": {"tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30}]}},
        "spec.prefill.tolerations[0].tolerationSeconds",
        "tolerations[].tolerationSeconds is only allowed with effect NoExecute",
    ),
    Case(
        "toleration-seconds-no-effect",
        {"decode": {"tolerations": [{"key": "gpu", "tolerationSeconds": 30}]}},
        "spec.decode.tolerations[0].tolerationSeconds",
        "tolerations[].tolerationSeconds is only allowed with effect NoExecute",
    ),
    Case(
        "toleration-key-not-qualified",
        {"router": {"tolerations": [{"key": "gpu node", "operator": "Exists"}]}},
        "spec.router.tolerations[0].key",
        "should match",
    ),
    Case(
        "toleration-equal-without-key",
        {"prefill": {"tolerations": [{"operator": "Equal", "value": "x"}]}},
        "spec.prefill.tolerations[0].operator",
        "tolerations[].operator must be Exists when key is empty",
    ),
    Case(
        "toleration-value-not-a-label-value",
        {"decode": {"tolerations": [{"key": "gpu", "value": "a b"}]}},
        "spec.decode.tolerations[0].value",
        "should match",
    ),
    Case(
        "priority-class-not-subdomain",
        {"prefill": {"priorityClassName": "High_Priority"}},
        "spec.prefill.priorityClassName",
        "should match",
    ),
    Case(
        "priority-class-double-dot",
        {"router": {"priorityClassName": "a..b"}},
        "spec.router.priorityClassName",
        "should match",
    ),
    Case(
        "affinity-wrong-type",
        {"prefill": {"affinity": {"nodeAffinity": "mi300x"}}},
        "spec.prefill.affinity.nodeAffinity",
        "must be of type object",
    ),
    Case(
        "affinity-unknown-operator",
        {
            "decode": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "Near", "values": ["a"]}]}
                            ]
                        }
                    }
                }
            }
        },
        "spec.decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].operator",
        "Unsupported value",
    ),
    Case(
        "affinity-in-without-values",
        {
            "prefill": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                        }
                    }
                }
            }
        },
        "spec.prefill.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].values",
        "values must not be empty when operator is In or NotIn",
    ),
    Case(
        "affinity-exists-with-values",
        {
            "prefill": {
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 5,
                                "preference": {
                                    "matchExpressions": [
                                        {"key": "zone", "operator": "Exists", "values": ["a"]}
                                    ]
                                },
                            }
                        ]
                    }
                }
            }
        },
        "spec.prefill.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
        ".matchExpressions[0].values",
        "values must be empty when operator is Exists or DoesNotExist",
    ),
    Case(
        "affinity-gt-not-an-integer",
        {
            "decode": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["four"]}]}
                            ]
                        }
                    }
                }
            }
        },
        "spec.decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].values",
        "values must be one integer when operator is Gt or Lt",
    ),
    Case(
        "affinity-no-terms",
        {
            "prefill": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}
                    }
                }
            }
        },
        "spec.prefill.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
        "should have at least 1 items",
    ),
    Case(
        "affinity-weight-zero",
        {
            "decode": {
                "affinity": {
                    "podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 0, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
                        ]
                    }
                }
            }
        },
        "spec.decode.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight",
        "greater than or equal to 1",
    ),
    Case(
        "affinity-without-topology-key",
        {
            "router": {
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {"labelSelector": {"matchLabels": {"app": "x"}}}
                        ]
                    }
                }
            }
        },
        "spec.router.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",
        "Required value",
    ),
    Case(
        "affinity-label-selector-bad-value",
        {
            "prefill": {
                "affinity": {
                    "podAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "topologyKey": "zone",
                                "labelSelector": {
                                    "matchExpressions": [
                                        {"key": "app", "operator": "In", "values": ["not a value"]}
                                    ]
                                },
                            }
                        ]
                    }
                }
            }
        },
        "spec.prefill.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector"
        ".matchExpressions[0].values[0]",
        "should match",
    ),
    Case(
        "affinity-unknown-field",
        {"decode": {"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}}},
        "spec.decode.affinity.nodeAffinity.requiredDuringScheduling",
        "unknown field",
    ),
    Case(
        "gpu-resource-gpu",
        {"prefill": {"resources": {"gpuResource": "gpu"}}},
        "spec.prefill.resources.gpuResource",
        "should match",
    ),
    Case(
        "gpu-resource-cpu",
        {"decode": {"resources": {"gpuResource": "cpu"}}},
        "spec.decode.resources.gpuResource",
        "should match",
    ),
    Case(
        "gpu-resource-native-domain",
        {"prefill": {"resources": {"gpuResource": "kubernetes.io/gpu"}}},
        "spec.prefill.resources.gpuResource",
        "must be an extended resource name",
    ),
    Case(
        "env-kv-transfer-key",
        {"engine": {"env": [{"name": "BATON_KV_TRANSFER_KEY", "value": "mine"}]}},
        "spec.engine.env[0].name",
        "env[].name: the operator sets",
    ),
    Case(
        "env-pod-ip-in-override",
        {"decode": {"engine": {"env": [{"name": "BATON_POD_IP", "value": "1.2.3.4"}]}}},
        "spec.decode.engine.env[0].name",
        "env[].name: the operator sets",
    ),
    Case(
        "env-duplicate-name",
        {"engine": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
        "spec.engine.env[1]",
        "Duplicate value",
        pydantic_field="spec.engine.env",
    ),
    Case(
        "pvc-claim-double-dot",
        {"model": {"source": "pvc://a..b/models"}},
        "spec.model.source",
        "should match",
    ),
    Case(
        "pvc-claim-too-long",
        {"model": {"source": "pvc://" + ".".join(["c" * 63] * 4) + "/m"}},
        "spec.model.source",
        "the claim name must be at most 253 characters",
    ),
    Case(
        "hf-token-secret-name",
        {"model": {"source": "hf:org/name", "hfTokenSecret": {"name": "a..b"}}},
        "spec.model.hfTokenSecret.name",
        "should match",
    ),
    Case(
        "hf-token-secret-key",
        {"model": {"source": "hf:org/name", "hfTokenSecret": {"name": "hf", "key": "my token"}}},
        "spec.model.hfTokenSecret.key",
        "should match",
    ),
    Case(
        "image-with-space", {"engine": {"image": "registry/engine :1"}}, "spec.engine.image", "should match"
    ),
    Case("router-image-with-space", {"router": {"image": " router:1"}}, "spec.router.image", "should match"),
]
SPEC_CASES += CHILD_REFUSED_CASES

#: Specs at the limits of what the CRD accepts: the API server must accept each one's children.
AT_THE_LIMITS: dict[str, dict[str, Any]] = {
    # The TP producer's KV-transfer range touching the other ports, and the last TCP port.
    "tp-kv-ports-touching": {
        "prefill": {"resources": {"gpus": 2}},
        "kvTransfer": {"port": 5555},  # 5555..5556, then kvEvents 5557
        "engine": {"port": 5554},
    },
    "tp-kv-ports-end-65535": {"prefill": {"resources": {"gpus": 4}}, "kvTransfer": {"port": 65532}},
    "tp-consumer-no-kv-ports": {
        "decode": {"resources": {"gpus": 4}},  # decode pods serve no pulls
        "kvEvents": {"port": 5601, "replayPort": 5602},
    },
    "label-keys-and-values": {
        "prefill": {
            "nodeSelector": {("p" * 63 + "." + "q" * 189)[:253] + "/" + "n" * 63: "v" * 63, "zone": ""}
        },
        "router": {"nodeSelector": {"a.b-c/x_y.z": "A-b_c.9"}},
    },
    "tolerations": {
        "decode": {
            "tolerations": [
                {"operator": "Exists"},
                {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "team", "value": "ml-" + "x" * 60, "effect": "PreferNoSchedule"},
            ]
        }
    },
    "affinity": {
        "prefill": {
            "priorityClassName": "system-node-critical.a-b",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "node.kubernetes.io/instance-type",
                                        "operator": "In",
                                        "values": ["mi300x"],
                                    },
                                    {"key": "gpus", "operator": "Gt", "values": ["3"]},
                                    {"key": "spot", "operator": "DoesNotExist"},
                                ],
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "NotIn", "values": ["node-1"]}
                                ],
                            }
                        ]
                    },
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
                        }
                    ],
                },
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {
                                "matchLabels": {"baton.dev/role": "prefill"},
                                "matchExpressions": [
                                    {"key": "tier", "operator": "NotIn", "values": ["", "b"]}
                                ],
                            },
                            "namespaces": ["a", "b-c"],
                            "matchLabelKeys": ["pod-template-hash"],
                        }
                    ],
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "namespaceSelector": {}}}
                    ],
                },
                "podAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 50, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {}}}
                    ]
                },
            },
        }
    },
    "resources-and-env": {
        "engine": {"env": [{"name": "MY_FLAG", "value": "1"}, {"name": "HOME_DIR", "value": "/x"}]},
        "prefill": {"resources": {"gpuResource": "nvidia.com/gpu", "gpus": 64}},
        "decode": {
            "resources": {"gpuResource": "gpu.intel.com/i915"},
            "engine": {"env": [{"name": "B", "value": ""}]},
        },
    },
    "pvc-claim": {"model": {"source": "pvc://" + ".".join(["c" * 63] * 3) + ".d" * 31 + "/m/x"}},
    "hf-secret": {
        "model": {"source": "hf:org/name", "hfTokenSecret": {"name": "hf.tokens-1", "key": "-._tok3n"}}
    },
}

NAME_CASES: list[Case] = [
    Case("name-too-long", {}, "metadata.name", "at most 40 characters", name="a" * 41),
    Case("name-with-dot", {}, "metadata.name", "DNS-1035 label", name="web.v2"),
]
