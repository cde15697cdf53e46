"""Operator benchmark: apply-to-children latency and reconcile throughput on the local control plane.

A private cluster of the harness (baton_dev: API server, controller manager, scheduler, kwok GPU
nodes and one process node) is started; `helm install` of the chart runs the operator as a pod
on the process node with the chart's ServiceAccount. Engine pods and routers select the kwok
nodes, so the Deployment/ReplicaSet controllers, the scheduler and kwok work alongside the
operator (nothing runs in the pods). Phase 1 creates 50 InferenceDeployments one at a time and
times each from create to "every child applied" (status.observedGeneration == 1, which the
operator writes only after its last apply). Phase 2 creates 200 at once and times until all are
reconciled; the operator's peak RSS is read from /proc of its pod process and its API request
counts from its metrics; then how long until every pod of phase 2 is scheduled and Running.

    python -m bench.operator --json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from baton_dev.binaries import find_binaries
from baton_dev.cluster import leftover_pod_processes, start_cluster, stop_cluster
from baton_dev.demo_manifests import PROCESS_NODES, chart_values
from baton_dev.kubeapi import ApiError
from baton_dev.spec import KWOK_TOLERATION, NODE_TYPE_LABEL, ClusterSpec
from baton_dev.state import ClusterState
from baton_dev.testing import DevCluster, is_ready
from baton_support.wait import wait_for

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "baton"
KWOK = {NODE_TYPE_LABEL: "kwok"}
SPEC = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    **{
        role: {"nodeSelector": KWOK, "tolerations": [KWOK_TOLERATION]}
        for role in ("prefill", "decode", "router")
    },
}
INFDS = "/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments"
PODS_PER_RESOURCE = 3  # prefill, decode, router: one each by default
SEQ_NS, BURST_NS = "bench-operator-seq", "bench-operator-burst"
NAMESPACES = (SEQ_NS, BURST_NS)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def create(cluster: DevCluster, namespace: str, name: str) -> None:
    body = {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name}}
    cluster.admin.post(INFDS.format(ns=namespace), {**body, "spec": SPEC})


def reconciled(cluster: DevCluster, namespace: str) -> set[str]:
    items = cluster.admin.get(INFDS.format(ns=namespace))["items"]
    return {i["metadata"]["name"] for i in items if (i.get("status") or {}).get("observedGeneration") == 1}


def wait_all(cluster: DevCluster, namespace: str, names: set[str], timeout_s: float, poll_s: float) -> float:
    start = time.monotonic()
    wait_for(
        lambda: names <= reconciled(cluster, namespace),
        timeout=timeout_s,
        interval=poll_s,
        message=f"{len(names)} resources reconciled",
    )
    return time.monotonic() - start


def running_pods(cluster: DevCluster, namespace: str) -> int:
    return sum(1 for p in cluster.pods(namespace) if p["status"].get("phase") == "Running" and is_ready(p))


def operator_pid(cluster: DevCluster) -> int:
    """The operator's process: the only pod process of the process node running baton-operator."""
    for record in leftover_pod_processes(cluster.state):
        try:
            cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"baton-operator") for part in cmdline):
            return record.pid
    raise RuntimeError("no baton-operator pod process on the process node")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def operator_metrics(cluster: DevCluster) -> str:
    """The operator pod's /metrics text (its `metrics` container port on its pod IP)."""
    (pod,) = [p for p in cluster.pods("baton-system") if is_ready(p)]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    url = f"http://{pod['status']['podIP']}:{ports['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


METRIC_LINE = re.compile(r"^(baton_operator_[a-z_]+_total)\{([^}]*)\} ([0-9.e+]+)$")


def operator_counts(text: str) -> dict[str, Counter[str]]:
    """Counter totals by metric name, keyed by their label values joined with '/'."""
    counts: dict[str, Counter[str]] = {}
    for line in text.splitlines():
        if found := METRIC_LINE.match(line):
            name, labels, value = found.groups()
            key = "/".join(v for _, v in re.findall(r'(\w+)="([^"]*)"', labels))
            counts.setdefault(name, Counter())[key] += int(float(value))
    return counts


def install_operator(cluster: DevCluster, workdir: Path) -> None:
    values = {**chart_values(PROCESS_NODES), "resyncSeconds": 3600, "peering": {"enabled": False}}
    values_file = workdir / "values.json"
    values_file.write_text(json.dumps(values))
    cluster.helm(
        "install", "baton", str(CHART), "-n", "baton-system", "--create-namespace", "-f", str(values_file)
    )
    wait_for(
        lambda: any(is_ready(p) for p in cluster.pods("baton-system")),
        timeout=180,
        interval=0.5,
        message="the operator pod Ready",
    )


def leave_cluster(cluster: DevCluster) -> None:
    """Undo what the bench did to a cluster it did not start: its namespaces, then the chart."""
    for ns in NAMESPACES:
        try:
            cluster.admin.delete(f"/api/v1/namespaces/{ns}")
        except ApiError as exc:
            if exc.status != 404:
                raise
    cluster.helm("uninstall", "baton", "-n", "baton-system", "--wait", "--timeout", "120s")

    def namespaces_gone() -> bool:
        items = cluster.admin.get("/api/v1/namespaces")["items"]
        return not {n["metadata"]["name"] for n in items} & set(NAMESPACES)

    wait_for(namespaces_gone, timeout=180, interval=0.5, message="the bench's namespaces deleted")
    cluster.close()


def create_namespace(cluster: DevCluster, name: str) -> None:
    try:
        cluster.admin.post("/api/v1/namespaces", {"metadata": {"name": name}})
    except ApiError as exc:
        if exc.status != 409:
            raise


def run(
    sequential: int, burst: int, kwok_nodes: int, kwok_gpus: int, cluster_dir: Path | None = None
) -> dict[str, Any]:
    """Measure on a private cluster, or on the running one in ``cluster_dir`` (left running: the
    chart is uninstalled and the bench's namespaces deleted afterwards)."""
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        if cluster_dir is None:
            spec = ClusterSpec(
                name="bench-operator", kwok_nodes=kwok_nodes, kwok_gpus=kwok_gpus, process_nodes=1
            )
            state = start_cluster(spec, find_binaries(), directory=Path(tmp) / "cluster", timeout_s=180.0)
        else:
            state = ClusterState.load(cluster_dir)
        cluster = DevCluster.attach(state)
        try:
            install_operator(cluster, Path(tmp))
            for ns in NAMESPACES:
                create_namespace(cluster, ns)
            pid = operator_pid(cluster)
            latencies = []
            for i in range(sequential):
                name = f"seq-{i}"
                start = time.monotonic()
                create(cluster, SEQ_NS, name)
                wait_all(cluster, SEQ_NS, {name}, 60, 0.02)
                latencies.append(time.monotonic() - start)
            names = {f"burst-{i}" for i in range(burst)}
            start = time.monotonic()
            for name in sorted(names):
                create(cluster, BURST_NS, name)
            create_s = time.monotonic() - start
            wait_all(cluster, BURST_NS, names, 600, 0.2)
            burst_s = time.monotonic() - start
            rss = peak_rss_mb(pid)
            pods = burst * PODS_PER_RESOURCE
            wait_for(
                lambda: running_pods(cluster, BURST_NS) >= pods,
                timeout=600,
                interval=1.0,
                message=f"{pods} pods Running and Ready",
            )
            pods_s = time.monotonic() - start
            counts = operator_counts(operator_metrics(cluster))
        finally:
            if cluster_dir is None:
                cluster.close()
                stop_cluster(state)
            else:
                leave_cluster(cluster)
    resources = sequential + burst
    requests = counts.get("baton_operator_api_requests_total", Counter())
    patches = counts.get("baton_operator_status_patches_total", Counter())
    return {
        "resources_sequential": sequential,
        "apply_to_children_p50_s": round(statistics.median(latencies), 4),
        "apply_to_children_p99_s": round(percentile(latencies, 99), 4),
        "apply_to_children_max_s": round(max(latencies), 4),
        "resources_burst": burst,
        f"reconcile_{burst}_s": round(burst_s, 2),
        # Part of the above: the bench's own sequential POSTs of the burst (admin client).
        f"create_{burst}_s": round(create_s, 2),
        "operator_rss_mb": round(rss, 1),
        "children_per_resource": 14,
        "kwok_nodes": kwok_nodes,
        f"burst_pods_running_{pods}_s": round(pods_s, 1),
        # The operator's own client until every pod ran (Kopf's watches and patches excluded).
        "api_requests_per_resource": round(sum(requests.values()) / resources, 2),
        "api_requests_by_verb_resource": dict(sorted(requests.items())),
        "status_patches": dict(sorted(patches.items())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.operator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument("--burst", type=int, default=200)
    # 110 pods per kwok node: 8 nodes hold the 750 pods of 250 resources, 64 GPUs each their 500.
    parser.add_argument("--kwok-nodes", type=int, default=8)
    parser.add_argument("--kwok-gpus", type=int, default=64)
    parser.add_argument(
        "--cluster-dir",
        type=Path,
        help="measure on this running local cluster (baton-dev's state directory; it needs kwok nodes "
        "and a process node) instead of starting one",
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 sequential + 4 burst resources on 1 kwok node: a smoke run"
    )
    args = parser.parse_args()
    if args.quick:
        args.sequential, args.burst, args.kwok_nodes, args.kwok_gpus = 2, 4, 1, 16
    result = {
        "bench": "operator",
        "quick": args.quick,
        **run(args.sequential, args.burst, args.kwok_nodes, args.kwok_gpus, args.cluster_dir),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
