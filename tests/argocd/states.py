"""InferenceDeployments in each state Argo CD tells apart, made for real: the operator's reconcile
against the local control plane, pods made by its controllers on kwok nodes. The committed
fixtures (the chart's testdata/) are these objects as captured; regenerate them with
`python -m tests.argocd.states` (it starts a cluster of its own).
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from baton_dev import spec as cluster_spec
from baton_dev.testing import DevCluster
from baton_operator.kube import KubeError
from baton_operator.reconcile import OperatorConfig, reconcile
from baton_support.wait import wait_for
from tests.argocd.lua_health import CUSTOMIZATION
from tests.operator_tests.cases import VALID_SPEC, merged
from tests.operator_tests.kube_helpers import dev_cluster_kube

TESTDATA = CUSTOMIZATION / "testdata"
KWOK = {cluster_spec.NODE_TYPE_LABEL: "kwok"}
ON_KWOK = {"nodeSelector": KWOK, "tolerations": [cluster_spec.KWOK_TOLERATION]}
SMALL = {"resources": {"gpus": 0, "cpu": "100m", "memory": "256Mi"}, **ON_KWOK}
INFDS = "/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments"


def _spec(prefill: int, decode: int) -> dict[str, Any]:
    return merged(
        VALID_SPEC,
        {
            "autoscaling": {"mode": "off"},
            "prefill": {"replicas": prefill, **SMALL},
            "decode": {"replicas": decode, **SMALL},
            "router": ON_KWOK,
        },
    )


#: Resource name -> spec, one per state that needs a resource of its own.
SPECS: dict[str, dict[str, Any]] = {
    "h": _spec(1, 1),
    "z": _spec(0, 0),
    "p": _spec(0, 1),
    "a": merged(
        VALID_SPEC,
        {
            "mode": "aggregated",
            "autoscaling": {"mode": "off"},
            "pool": {"replicas": 1, **SMALL},
            "router": ON_KWOK,
        },
    ),  # fmt: skip
    "d": _spec(1, 1),
}


def _foreign_deployment(name: str) -> dict[str, Any]:
    """A Deployment someone else made under the name Baton wants, with another selector (which is
    immutable): Baton's apply of it is refused, so the reconcile fails."""
    labels = {"app": "someone-else"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }


def _ready(cluster: DevCluster, namespace: str, names: list[str]) -> bool:
    for name in names:
        deployment = cluster.admin.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
        want = deployment["spec"].get("replicas", 1)
        if deployment.get("status", {}).get("readyReplicas", 0) != want:
            return False
    return True


async def produce(cluster: DevCluster, namespace: str) -> dict[str, dict[str, Any]]:
    """Fixture name -> the live InferenceDeployment in that state."""
    infds = INFDS.format(ns=namespace)
    cfg = OperatorConfig()
    states: dict[str, dict[str, Any]] = {}
    cluster.admin.post(f"/apis/apps/v1/namespaces/{namespace}/deployments", _foreign_deployment("d-decode"))
    bodies = {}
    for name, spec in SPECS.items():
        doc = {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name}}
        bodies[name] = cluster.admin.post(infds, {**doc, "spec": spec})
    states["no-status"] = cluster.admin.get(f"{infds}/h")
    kube = dev_cluster_kube(cluster)
    try:
        for name, body in bodies.items():
            if name == "d":
                try:
                    await reconcile(kube, body, cfg)
                except KubeError as exc:
                    assert exc.status == 422, exc
                else:
                    raise AssertionError("the reconcile of d should fail on the foreign Deployment")
            else:
                await reconcile(kube, body, cfg)
        states["pods-starting"] = cluster.admin.get(f"{infds}/h")
        states["degraded"] = cluster.admin.get(f"{infds}/d")
        deployments = [f"{n}-{r}" for n in ("h", "z", "p") for r in ("prefill", "decode", "router")]
        deployments += ["a-engine", "a-router"]
        await asyncio.to_thread(
            lambda: wait_for(
                lambda: _ready(cluster, namespace, deployments),
                180.0,
                interval=0.1,
                message="every Deployment Ready",
            )
        )
        for name in ("h", "z", "p", "a"):
            await reconcile(kube, cluster.admin.get(f"{infds}/{name}"), cfg)  # reads the Deployments' status
        states["healthy"] = cluster.admin.get(f"{infds}/h")
        states["suspended"] = cluster.admin.get(f"{infds}/z")
        states["partly-scaled-to-zero"] = cluster.admin.get(f"{infds}/p")
        states["aggregated-healthy"] = cluster.admin.get(f"{infds}/a")
        patch = {"spec": {"engine": {"maxNumSeqs": 128}}}
        states["spec-changed"] = cluster.admin.patch(f"{infds}/h", patch)
    finally:
        await kube.close()
    return states


def fixture(obj: dict[str, Any]) -> dict[str, Any]:
    """What a committed fixture keeps of a live object: no server bookkeeping."""
    meta = obj["metadata"]
    kept = {k: meta[k] for k in ("name", "namespace", "generation", "creationTimestamp") if k in meta}
    out = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": kept,
        "spec": copy.deepcopy(obj["spec"]),
    }
    if "status" in obj:
        out["status"] = copy.deepcopy(obj["status"])
    return out


def shape(obj: dict[str, Any]) -> dict[str, Any]:
    """What must agree between a fixture and a fresh live object of the same state (not names,
    times or messages that carry them)."""
    status = obj.get("status") or {}
    return {
        "generation": obj["metadata"].get("generation"),
        "observedGeneration": status.get("observedGeneration"),
        "conditions": [
            (c["type"], c["status"], c["reason"], c.get("observedGeneration"))
            for c in status.get("conditions") or []
        ],
        "pools": {
            key: (status[key]["desiredReplicas"], status[key]["readyReplicas"])
            for key in ("prefill", "decode", "pool", "router")
            if status.get(key)
        },
    }


def write(states: dict[str, dict[str, Any]], directory: Path = TESTDATA) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    header = "# Captured from the local control plane by `python -m tests.argocd.states`.\n"
    for name, obj in sorted(states.items()):
        text = yaml.safe_dump(fixture(obj), sort_keys=False, width=100)
        (directory / f"{name}.yaml").write_text(header + text)


def main() -> int:
    import tempfile

    from baton_dev.binaries import find_binaries
    from baton_dev.cluster import start_cluster, stop_cluster
    from baton_dev.pytest_plugin import TEST_CLUSTER
    from baton_operator import crd
    from tests.operator_tests.kube_helpers import install_crd_in

    with tempfile.TemporaryDirectory(prefix="baton-argocd-") as tmp:
        state = start_cluster(TEST_CLUSTER, find_binaries(), directory=Path(tmp))
        cluster = DevCluster.attach(state)
        try:
            install_crd_in(cluster, crd.crd())
            with cluster.namespace("argocd-health") as namespace:
                write(asyncio.run(produce(cluster, namespace)))
        finally:
            cluster.close()
            stop_cluster(state)
    print(f"wrote {TESTDATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
