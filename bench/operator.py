"""Operator benchmark: apply-to-children latency and reconcile throughput on a real API server.

The operator runs as a process with the chart's ServiceAccount against etcd + kube-apiserver
(nothing is scheduled: this measures the control plane's work, not pods). Phase 1 creates 50
InferenceDeployments one at a time and times each from create to "every child applied"
(status.observedGeneration == 1, which the operator writes only after its last apply). Phase 2
creates 200 at once and times until all are reconciled; the operator's peak RSS is read from
/proc at the end.

    python -m bench.operator --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.operator_tests.apiserver import api_server, binary_dir
from tests.operator_tests.kube_helpers import Rest
from tests.operator_tests.operator_process import install_chart, operator_kubeconfig, operator_process
from tests.operator_tests.scratch_venv import image_venv

SPEC = {"model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"}}
INFDS = "/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def create(rest: Rest, namespace: str, name: str) -> None:
    body = {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name}}
    status, answer = rest.call("POST", INFDS.format(ns=namespace), {**body, "spec": SPEC})
    if status != 201:
        raise RuntimeError(f"create {name}: HTTP {status} {answer}")


def reconciled(rest: Rest, namespace: str) -> set[str]:
    items = rest.get(INFDS.format(ns=namespace))["items"]
    return {i["metadata"]["name"] for i in items if i.get("status", {}).get("observedGeneration") == 1}


def wait_all(rest: Rest, namespace: str, names: set[str], timeout_s: float, poll_s: float = 0.02) -> float:
    start = time.monotonic()
    while not names <= reconciled(rest, namespace):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(
                f"{len(names - reconciled(rest, namespace))} not reconciled after {timeout_s}s"
            )
        time.sleep(poll_s)
    return time.monotonic() - start


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def run(sequential: int, burst: int) -> dict[str, Any]:
    bin_dir = binary_dir()
    if bin_dir is None:
        raise SystemExit("etcd/kube-apiserver not built: bash devcluster/scripts/build.sh")
    with (
        tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp,
        api_server(Path(tmp), bin_dir) as server,
    ):
        rest = Rest(server)
        sa = install_chart(rest, bin_dir / "helm")
        kubeconfig, _ = operator_kubeconfig(server, rest, sa, Path(tmp) / "operator.kubeconfig")
        for ns in ("seq", "burst"):
            rest.call(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
        # The operator runs from a venv holding only what its image installs (baton[operator]).
        python, done = image_venv(Path(tmp) / "venv", "operator")
        if done.returncode != 0:
            raise SystemExit(f"installing baton[operator] failed:\n{done.stdout}{done.stderr}")
        with operator_process(
            kubeconfig, Path(tmp), "--resync-seconds=3600", "--no-peering", python=python
        ) as operator:
            latencies = []
            for i in range(sequential):
                name = f"seq-{i}"
                start = time.monotonic()
                create(rest, "seq", name)
                wait_all(rest, "seq", {name}, 60)
                latencies.append(time.monotonic() - start)
            names = {f"burst-{i}" for i in range(burst)}
            start = time.monotonic()
            for name in sorted(names):
                create(rest, "burst", name)
            wait_all(rest, "burst", names, 600, poll_s=0.2)
            burst_s = time.monotonic() - start
            rss = peak_rss_mb(operator.proc.pid)
    return {
        "resources_sequential": sequential,
        "apply_to_children_p50_s": round(statistics.median(latencies), 4),
        "apply_to_children_p99_s": round(percentile(latencies, 99), 4),
        "apply_to_children_max_s": round(max(latencies), 4),
        "resources_burst": burst,
        f"reconcile_{burst}_s": round(burst_s, 2),
        "operator_rss_mb": round(rss, 1),
        "children_per_resource": 14,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument("--burst", type=int, default=200)
    args = parser.parse_args()
    result = run(args.sequential, args.burst)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
