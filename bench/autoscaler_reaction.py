"""Reaction of the built-in autoscaler inside `baton-operator run`: an engine's queue depth
crosses its target -> the role Deployment's replicas are patched (observed on the API server).

A real etcd + kube-apiserver with the chart's RBAC, the operator as a process, an engine pod as
a Pod object (status written by the bench: there is no kubelet) whose /metrics is a real HTTP
server the bench sets. Each trial puts the crossing at a different phase of the interval.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from baton_support.apiserver import Rest, api_server, binary_dir
from baton_support.fake_engines import Load, add_ready_pod, deployment_path, replicas
from baton_support.operator_process import install_chart, operator_kubeconfig, operator_process
from baton_support.wait import wait_for

NS = "autoscale-bench"


def _spec(interval_s: int) -> dict[str, Any]:
    return {
        "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
        "autoscaling": {
            "mode": "builtin",
            "intervalSeconds": interval_s,
            "prefill": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4},
            "decode": {"minReplicas": 1, "maxReplicas": 1, "targetKVUsage": 0.7},
            "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2},
            "scaleDown": {"stabilizationWindowSeconds": 0, "maxStep": 4},
        },
    }


def measure(interval_s: int = 1, trials: int = 6, poll_s: float = 0.01) -> list[float]:
    """Seconds from the crossing to the patched replicas seen by a GET polling every `poll_s`."""
    bin_dir = binary_dir()
    if bin_dir is None:
        raise SystemExit("etcd/kube-apiserver not built: bash devcluster/scripts/build.sh")
    rng = random.Random(7)
    loads = {"prefill": Load(), "decode": Load()}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-autoscaler-") as tmp,
            api_server(Path(tmp), bin_dir) as server,
        ):
            rest = Rest(server)
            sa = install_chart(rest, bin_dir / "helm")
            kubeconfig, _ = operator_kubeconfig(server, rest, sa, Path(tmp) / "operator.kubeconfig")
            rest.call(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            )
            with operator_process(kubeconfig, Path(tmp), "--resync-seconds=3600", "--no-peering"):
                body = {
                    "apiVersion": "baton.dev/v1alpha1",
                    "kind": "InferenceDeployment",
                    "metadata": {"name": "r"},
                }
                status, answer = rest.call(
                    "POST",
                    f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferencedeployments",
                    {**body, "spec": _spec(interval_s)},
                )
                if status != 201:
                    raise RuntimeError(f"creating the InferenceDeployment: HTTP {status} {answer}")
                wait_for(
                    lambda: rest.call("GET", deployment_path(NS, "r-prefill"))[0] == 200,
                    60,
                    message="the Deployments",
                )
                for role, load in loads.items():
                    add_ready_pod(rest, NS, "r", role, load.port)

                def prefill() -> int:
                    return replicas(rest, NS, "r-prefill")

                reactions = []
                for _ in range(trials):
                    loads["prefill"].waiting = 0
                    wait_for(lambda: prefill() == 1, 30, interval=0.05, message="prefill back at 1")
                    time.sleep(rng.uniform(0.0, interval_s))  # a random phase of the interval
                    loads["prefill"].waiting = 12  # 12 waiting / target 4 -> 3 pods
                    crossed = time.monotonic()
                    wait_for(lambda: prefill() > 1, 30, interval=poll_s, message="prefill scaled up")
                    reactions.append(time.monotonic() - crossed)
                return reactions
    finally:
        for load in loads.values():
            load.server.stop()
