"""The pure builders: exact fields of the rendered children."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from baton_operator.builders import BuildContext, Children, Owner, desired_children, router_endpoint
from baton_operator.models import InferenceDeploymentSpec
from baton_operator.models.engine import OPERATOR_ENV
from tests.operator_tests.cases import DEMO_APPLIED_CHILDREN, VALID_SPEC, merged

OWNER = Owner(name="demo", namespace="llm", uid="0f1e-uid")
KEY = "ab" * 32


def build(patch: dict[str, Any] | None = None, **ctx: str) -> Children:
    spec = InferenceDeploymentSpec.model_validate(merged(VALID_SPEC, patch or {}))
    return desired_children(BuildContext(owner=OWNER, spec=spec, **ctx), KEY)


def by_kind(children: Children, kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in children.applied if m["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    result: dict[str, Any] = pod["containers"][0]
    return result


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_children_of_a_disaggregated_deployment() -> None:
    children = build()
    names = [(m["kind"], m["metadata"]["name"]) for m in children.applied]
    assert names == DEMO_APPLIED_CHILDREN
    assert [(m["kind"], m["metadata"]["name"]) for m in children.created_once] == [
        ("Secret", "demo-kv-transfer")
    ]
    assert [(crd, m["kind"]) for crd, m in children.optional] == [
        ("podmonitors.monitoring.coreos.com", "PodMonitor"),
        ("inferencepools.inference.networking.k8s.io", "InferencePool"),
    ]
    assert children.removed == []


def test_every_child_is_owned_and_labelled() -> None:
    children = build()
    everything = children.applied + children.created_once + [m for _, m in children.optional]
    for manifest in everything:
        meta = manifest["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "baton.dev/v1alpha1",
                "kind": "InferenceDeployment",
                "name": "demo",
                "uid": "0f1e-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert "finalizers" not in meta
        assert meta["labels"]["app.kubernetes.io/name"] == "baton"
        assert meta["labels"]["app.kubernetes.io/instance"] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "baton-operator"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "baton"
        assert meta["labels"]["baton.dev/deployment"] == "demo"


@pytest.mark.parametrize(("mode", "has_replicas"), [("off", True), ("builtin", False), ("external", False)])
def test_role_replicas_are_applied_only_when_autoscaling_is_off(mode: str, has_replicas: bool) -> None:
    deployments = by_kind(build({"autoscaling": {"mode": mode}, "prefill": {"replicas": 3}}), "Deployment")
    assert ("replicas" in deployments["demo-prefill"]["spec"]) is has_replicas
    assert ("replicas" in deployments["demo-decode"]["spec"]) is has_replicas
    if has_replicas:
        assert deployments["demo-prefill"]["spec"]["replicas"] == 3
        assert deployments["demo-decode"]["spec"]["replicas"] == 1
    assert deployments["demo-router"]["spec"]["replicas"] == 1  # the router is never autoscaled


def test_engine_args_flags_and_kv_roles() -> None:
    deployments = by_kind(build({"engine": {"maxNumSeqs": 32, "prefixCaching": False}}), "Deployment")
    prefill = container(deployments["demo-prefill"])
    decode = container(deployments["demo-decode"])
    assert prefill["command"] == ["baton-engine", "serve"]
    assert prefill["args"] == [
        "--model", "builtin:smollm2-135m-instruct",
        "--served-model-name", "smollm2",
        "--host", "$(BATON_POD_IP)",
        "--port", "8000",
        "--device", "cuda",
        "--dtype", "auto",
        "--block-size", "16",
        "--max-num-seqs", "32",
        "--max-num-batched-tokens", "2048",
        "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.9",
        "--no-enable-prefix-caching",
        "--prefix-hash", "fast",
        "--enable-chunked-prefill",
        "--max-queued-requests", "1024",
        "--kv-role", "producer",
        "--kv-transfer-port", "5600",
        "--kv-lease-seconds", "30",
        "--kv-transfer-on-failure", "recompute",
        "--kv-events",
        "--kv-compat-key", "9b3e36acc617fe58",
        "--tensor-parallel-size", "1",
        "--kv-events-port", "5557",
        "--kv-events-replay-port", "5558",
        "--kv-events-buffer-steps", "10000",
        "--kv-events-encoding", "map",
    ]  # fmt: skip
    assert flag(decode["args"], "--kv-role") == "consumer"
    assert [(p["name"], p["containerPort"]) for p in prefill["ports"]] == [
        ("http", 8000), ("kv-transfer", 5600), ("kv-events", 5557), ("kv-replay", 5558),
    ]  # fmt: skip
    # A consumer serves no pulls.
    assert [p["name"] for p in decode["ports"]] == ["http", "kv-events", "kv-replay"]


def test_tensor_parallel_size_defaults_to_the_gpus_and_gets_a_memory_backed_shm() -> None:
    children = build(
        {
            "prefill": {"resources": {"gpus": 2}},  # TP 2 by default
            "decode": {"resources": {"gpus": 4}, "engine": {"tensorParallelSize": 2}},
        }
    )
    deployments = by_kind(children, "Deployment")
    # Producer rank r serves its KV heads on kvTransfer.port + r; a consumer serves none.
    ranks = [
        ("http", 8000),
        ("kv-transfer", 5600),
        ("kv-transfer-1", 5601),
        ("kv-events", 5557),
        ("kv-replay", 5558),
    ]
    assert [(p["name"], p["containerPort"]) for p in container(deployments["demo-prefill"])["ports"]] == ranks
    assert [
        (p["name"], p["port"]) for p in by_kind(children, "Service")["demo-prefill"]["spec"]["ports"]
    ] == ranks
    assert [p["name"] for p in container(deployments["demo-decode"])["ports"]] == [
        "http",
        "kv-events",
        "kv-replay",
    ]
    tp = {
        name: flag(container(d)["args"], "--tensor-parallel-size")
        for name, d in deployments.items()
        if name != "demo-router"
    }
    assert tp == {"demo-prefill": "2", "demo-decode": "2"}
    pod = deployments["demo-prefill"]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(deployments["demo-prefill"])["volumeMounts"]
    # One rank needs no shared memory between ranks.
    one = by_kind(build(), "Deployment")["demo-decode"]
    assert flag(container(one)["args"], "--tensor-parallel-size") == "1"
    assert [v["name"] for v in one["spec"]["template"]["spec"]["volumes"]] == ["tmp", "cache"]
    # CPU pods (no GPUs) run any size as processes.
    cpu = by_kind(
        build(
            {
                "engine": {"device": "cpu", "tensorParallelSize": 3},
                "prefill": {"resources": {"gpus": 0}},
                "decode": {"resources": {"gpus": 0}},
            }
        ),
        "Deployment",
    )
    assert flag(container(cpu["demo-prefill"])["args"], "--tensor-parallel-size") == "3"
    # The pools of one deployment share their KV-compatibility key whatever their sizes.
    assert (
        len(
            {
                flag(container(d)["args"], "--kv-compat-key")
                for n, d in deployments.items()
                if n != "demo-router"
            }
        )
        == 1
    )


def test_fp8_weights_and_kv_cache_become_flags_every_engine_accepts() -> None:
    from baton_engine.cli import build_parser, config_from_args

    default = container(by_kind(build({}), "Deployment")["demo-prefill"])["args"]
    assert "--quantization" not in default and "--kv-cache-dtype" not in default
    patch = {"engine": {"quantization": "fp8", "kvCacheDtype": "fp8"}}
    for role in ("prefill", "decode"):
        args = container(by_kind(build(patch), "Deployment")[f"demo-{role}"])["args"]
        assert (flag(args, "--quantization"), flag(args, "--kv-cache-dtype")) == ("fp8", "fp8")
        config = config_from_args(build_parser().parse_args(["serve", *args]))
        assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")


def test_kv_events_off_drops_flags_and_ports() -> None:
    prefill = container(by_kind(build({"kvEvents": {"enabled": False}}), "Deployment")["demo-prefill"])
    assert "--no-kv-events" in prefill["args"]
    assert "--kv-events-port" not in prefill["args"]
    assert [p["name"] for p in prefill["ports"]] == ["http", "kv-transfer"]


def test_per_role_overrides() -> None:
    patch = {
        "engine": {"image": "engine:top", "maxNumSeqs": 64, "env": [{"name": "A", "value": "1"}]},
        "prefill": {"engine": {"maxNumSeqs": 4, "image": "engine:prefill", "extraArgs": ["--seed", "7"]}},
        "decode": {"engine": {"numKvBlocks": 999, "device": "cpu"}},
    }
    deployments = by_kind(build(patch), "Deployment")
    prefill, decode = container(deployments["demo-prefill"]), container(deployments["demo-decode"])
    assert (prefill["image"], flag(prefill["args"], "--max-num-seqs")) == ("engine:prefill", "4")
    assert prefill["args"][-2:] == ["--seed", "7"]
    assert "--num-kv-blocks" not in prefill["args"]
    assert (decode["image"], flag(decode["args"], "--max-num-seqs")) == ("engine:top", "64")
    assert (flag(decode["args"], "--num-kv-blocks"), flag(decode["args"], "--device")) == ("999", "cpu")
    assert {"name": "A", "value": "1"} in prefill["env"]
    assert {"name": "A", "value": "1"} in decode["env"]


def test_restricted_pod_security_and_probes() -> None:
    deployment = by_kind(build({"prefill": {"startupTimeoutSeconds": 1205}}), "Deployment")["demo-prefill"]
    pod = deployment["spec"]["template"]["spec"]
    engine = container(deployment)
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert engine["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 60
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 1210
    assert engine["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/var/cache/baton"},
    ]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]


def test_env_pod_ip_and_signing_key() -> None:
    engine = container(by_kind(build(), "Deployment")["demo-decode"])
    env = {e["name"]: e for e in engine["env"]}
    assert env["BATON_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["BATON_KV_TRANSFER_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "demo-kv-transfer", "key": "kv-transfer-key"}
    }
    secret = build().created_once[0]
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["kv-transfer-key"]).decode() == KEY


def test_user_env_cannot_collide_with_the_operators() -> None:
    """OPERATOR_ENV (what the CRD refuses in spec.engine.env) is exactly what the builders set."""
    engine = container(
        by_kind(build({"engine": {"env": [{"name": "MINE", "value": "1"}]}}), "Deployment")["demo-decode"]
    )
    assert sorted(e["name"] for e in engine["env"]) == sorted([*OPERATOR_ENV, "MINE"])


def test_resources_and_placement() -> None:
    patch = {
        "decode": {
            "resources": {"gpus": 2, "gpuResource": "nvidia.com/gpu", "cpu": 8, "memory": "64Gi"},
            "nodeSelector": {"pool": "mi300x"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 5,
                            "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
                        }
                    ]
                }
            },
            "priorityClassName": "llm",
        }
    }
    deployments = by_kind(build(patch), "Deployment")
    decode, prefill = deployments["demo-decode"], deployments["demo-prefill"]
    assert container(decode)["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    assert container(prefill)["resources"] == {"limits": {"amd.com/gpu": "1"}}
    pod = decode["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "mi300x"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # Only what was given: no empty lists or nulls for the fields left out.
    assert pod["affinity"] == {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
            ]
        }
    }
    assert pod["priorityClassName"] == "llm"
    assert "nodeSelector" not in prefill["spec"]["template"]["spec"]
    # Accelerator pools roll without a spare accelerator; CPU pools without downtime.
    assert decode["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    cpu = by_kind(build({"decode": {"resources": {"gpus": 0}}}), "Deployment")["demo-decode"]
    assert cpu["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert container(cpu)["resources"] == {}


def test_pvc_source_mounts_the_claim_read_only() -> None:
    deployments = by_kind(build({"model": {"source": "pvc://weights/llama/8b"}}), "Deployment")
    for name in ("demo-prefill", "demo-decode"):
        pod = deployments[name]["spec"]["template"]["spec"]
        engine = container(deployments[name])
        assert flag(engine["args"], "--model") == "/model/llama/8b"
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
            "volumes"
        ]
        assert {"name": "model", "mountPath": "/model", "readOnly": True} in engine["volumeMounts"]
        assert "initContainers" not in pod
    router = container(deployments["demo-router"])
    assert flag(router["args"], "--tokenizer") == "/model/llama/8b"


def test_hf_source_downloads_in_an_init_container() -> None:
    patch = {
        "model": {
            "source": "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
            "revision": "main",
            "hfTokenSecret": {"name": "hf-token"},
            "cacheSize": "20Gi",
        }
    }
    deployments = by_kind(build(patch), "Deployment")
    pod = deployments["demo-decode"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "model-download"
    assert init["image"] == "ghcr.io/baton-llm/baton-engine:0.1.0"
    assert init["args"] == ["HuggingFaceTB/SmolLM2-135M-Instruct", "main", "/model"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init[
        "env"
    ]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}} in pod["volumes"]
    assert flag(container(deployments["demo-decode"])["args"], "--model") == "/model"
    # The router fetches only the tokenizer files, with its own image.
    (router_init,) = deployments["demo-router"]["spec"]["template"]["spec"]["initContainers"]
    assert router_init["image"] == "ghcr.io/baton-llm/baton-router:0.1.0"
    assert router_init["args"][3:] == ["*.json", "*.jinja", "tokenizer.model", "*.txt"]


def test_aggregated_mode_is_one_pool_behind_the_router() -> None:
    children = build({"mode": "aggregated", "pool": {"replicas": 2}})
    deployments = by_kind(children, "Deployment")
    assert sorted(deployments) == ["demo-engine", "demo-router"]
    engine = container(deployments["demo-engine"])
    assert flag(engine["args"], "--kv-role") == "both"
    assert deployments["demo-engine"]["spec"]["replicas"] == 2
    assert deployments["demo-engine"]["spec"]["selector"]["matchLabels"] == {
        "baton.dev/deployment": "demo",
        "baton.dev/role": "engine",
    }
    router = container(deployments["demo-router"])
    assert flag(router["args"], "--engine-selector") == "baton.dev/deployment=demo,baton.dev/role=engine"
    assert "--prefill-selector" not in router["args"]
    assert sorted(by_kind(children, "PodDisruptionBudget")) == ["demo-engine", "demo-router"]


def test_router_discovery_flags_and_rbac() -> None:
    children = build({"router": {"port": 9000, "service": {"type": "LoadBalancer", "port": 443}}})
    router = container(by_kind(children, "Deployment")["demo-router"])
    assert router["command"] == ["baton-router"]
    assert router["args"] == [
        "--discovery", "kubernetes",
        "--namespace", "llm",
        "--mode", "disaggregated",
        "--prefill-selector", "baton.dev/deployment=demo,baton.dev/role=prefill",
        "--decode-selector", "baton.dev/deployment=demo,baton.dev/role=decode",
        "--model", "smollm2",
        "--tokenizer", "builtin:smollm2-135m-instruct",
        "--host", "$(BATON_POD_IP)",
        "--port", "9000",
        "--hold-queue", "64",
        "--hold-timeout", "120",
        "--kv-events",
    ]  # fmt: skip
    pod = by_kind(children, "Deployment")["demo-router"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-router"
    role = by_kind(children, "Role")["demo-router"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = by_kind(children, "RoleBinding")["demo-router"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "llm"}]
    service = by_kind(children, "Service")["demo-router"]["spec"]
    assert (service["type"], service["ports"][0]["port"], service["ports"][0]["targetPort"]) == (
        "LoadBalancer",
        443,
        "http",
    )
    spec = InferenceDeploymentSpec.model_validate(VALID_SPEC)
    assert router_endpoint(BuildContext(OWNER, spec)) == "http://demo-router.llm.svc:80"


def test_a_kv_layout_change_leaves_the_router_pod_alone() -> None:
    """Block size and prefix hash reach the router through each engine pod's annotations, so a
    rollout of either does not restart the router (it routes both generations meanwhile)."""
    before = by_kind(build(), "Deployment")["demo-router"]
    after = by_kind(build({"engine": {"blockSize": 32, "prefixHash": "vllm-sha256-cbor"}}), "Deployment")
    assert after["demo-router"] == before


def test_engine_services_are_headless() -> None:
    services = by_kind(build(), "Service")
    assert services["demo-prefill"]["spec"]["clusterIP"] == "None"
    assert services["demo-prefill"]["spec"]["selector"] == {
        "baton.dev/deployment": "demo",
        "baton.dev/role": "prefill",
    }
    assert [p["name"] for p in services["demo-decode"]["spec"]["ports"]] == ["http", "kv-events", "kv-replay"]
    assert "clusterIP" not in services["demo-router"]["spec"]


def test_network_policy_admits_router_peers_operator_and_monitoring() -> None:
    policy = by_kind(
        build(operator_namespace="baton-system", monitoring_namespace="monitoring"), "NetworkPolicy"
    )
    spec = policy["demo-engines"]["spec"]
    assert spec["podSelector"] == {
        "matchLabels": {"baton.dev/deployment": "demo"},
        "matchExpressions": [{"key": "baton.dev/role", "operator": "In", "values": ["decode", "prefill"]}],
    }
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [
        {
            "from": [
                {"podSelector": {"matchLabels": {"baton.dev/deployment": "demo"}}},
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "baton-system"}},
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/part-of": "baton",
                            "app.kubernetes.io/component": "operator",
                        }
                    },
                },
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
            ]
        }
    ]


def test_network_policy_disabled_is_removed() -> None:
    children = build({"networkPolicy": {"enabled": False}})
    assert by_kind(children, "NetworkPolicy") == {}
    assert children.removed == [("networking.k8s.io/v1", "NetworkPolicy", "demo-engines")]


def test_disruption_budgets() -> None:
    pdb = by_kind(build(), "PodDisruptionBudget")["demo-decode"]["spec"]
    assert pdb == {
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": {"matchLabels": {"baton.dev/deployment": "demo", "baton.dev/role": "decode"}},
    }


def test_pod_monitor_scrapes_every_pod_of_the_deployment() -> None:
    (_, monitor) = build().optional[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"] == {
        "selector": {"matchLabels": {"baton.dev/deployment": "demo"}},
        "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}],
    }


def test_builders_are_deterministic() -> None:
    assert build().applied == build().applied
