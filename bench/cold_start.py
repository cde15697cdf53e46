"""Cold start of a scaled-to-zero deployment: from a request reaching the router while every pool
is at zero pods, to its answer. Real engines (SmolLM2-135M on CPU) on the local control plane's
process node, the operator as a process; the router holds the request, the autoscaler sees it
and wakes the pools, their pods start, load the model and pass their readiness probe, the router
discovers them and sends the request through.

Reference, in the same run (next to each cold start: a shared machine's load changes by the
minute): the floor a pod start cannot beat, a standalone `baton-engine serve` with the pods'
flags, from process start to `/ready` (importing, loading the model), and what is left, the
orchestration: the autoscaler's wake-up, scheduling, probes, discovery.

    python -m bench.cold_start --json [--runs 3] [--cluster-dir DIR] [--quick]

Without --cluster-dir it starts (and stops) a private cluster. tests/rollout_e2e runs the quick
configuration's scenario (the helpers below) and checks its outcome.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from baton_dev.binaries import find_binaries
from baton_dev.cluster import start_cluster, stop_cluster
from baton_dev.demo_manifests import PROCESS_NODES, with_node_selector
from baton_dev.spec import ClusterSpec
from baton_dev.state import ClusterState
from baton_dev.testing import DevCluster, is_ready, wait_for
from baton_engine import contract
from baton_operator import models
from baton_support.operator_process import cluster_operator

NAME = "zero"
MODEL = "builtin:smollm2-135m-instruct"
ENGINE = {"device": "cpu", "dtype": "float32", "maxModelLen": 512, "numKvBlocks": 64}
POD = {"resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, "startupTimeoutSeconds": 600}
BODY = {"model": "smollm2", "prompt": "Say hello in French.", "max_tokens": 4, "temperature": 0}


@dataclass(frozen=True)
class Config:
    idle_s: int  # scaleToZeroIdleSeconds
    hold_queue: int  # spec.router.holdQueue
    runs: int


QUICK = Config(idle_s=15, hold_queue=3, runs=1)
FULL = Config(idle_s=15, hold_queue=3, runs=3)


def spec(config: Config) -> dict[str, Any]:
    """Both pools may go to zero; waking must not wait for the (long) scale-up window."""
    return {
        "model": {"name": "smollm2", "source": MODEL},
        "mode": "disaggregated",
        "engine": ENGINE,
        "prefill": POD,
        "decode": POD,
        "router": {"replicas": 1, "holdQueue": config.hold_queue, "holdTimeoutSeconds": 600},
        "autoscaling": {
            "mode": "builtin",
            "intervalSeconds": 2,
            "scaleToZeroIdleSeconds": config.idle_s,
            "prefill": {"minReplicas": 0, "maxReplicas": 1},
            "decode": {"minReplicas": 0, "maxReplicas": 1},
            "scaleUp": {"stabilizationWindowSeconds": 900, "maxStep": 1},
            "scaleDown": {"stabilizationWindowSeconds": 0, "maxStep": 1},
        },
    }


def http_url(pod: dict[str, Any], path: str) -> str:
    port = next(
        p["containerPort"]
        for c in pod["spec"]["containers"]
        for p in c.get("ports") or []
        if p["name"] == "http"
    )
    return f"http://{pod['status']['podIP']}:{port}{path}"


class ZeroDeployment:
    """The scaled-to-zero InferenceDeployment of one namespace."""

    def __init__(self, cluster: DevCluster, namespace: str) -> None:
        self.cluster, self.ns = cluster, namespace
        self.path = f"/apis/{models.API_VERSION}/namespaces/{namespace}/{models.PLURAL}/{NAME}"

    def create(self, config: Config) -> None:
        doc = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": NAME}}
        self.cluster.apply(with_node_selector({**doc, "spec": spec(config)}, PROCESS_NODES), self.ns)

    def pods(self, role: str) -> list[dict[str, Any]]:
        return self.cluster.pods(self.ns, f"{contract.LABEL_DEPLOYMENT}={NAME},{contract.LABEL_ROLE}={role}")

    def replicas(self, role: str) -> int:
        d = self.cluster.admin.get(f"/apis/apps/v1/namespaces/{self.ns}/deployments/{NAME}-{role}")
        return int(d["spec"].get("replicas", 1))

    def at_zero(self) -> bool:
        try:
            return all(self.replicas(r) == 0 and not self.pods(r) for r in ("prefill", "decode"))
        except httpx.TimeoutException:  # an API server starved by a loaded machine: look again
            return False

    def serving(self) -> bool:
        try:
            return all(len(p := self.pods(r)) == 1 and is_ready(p[0]) for r in ("prefill", "decode"))
        except httpx.TimeoutException:
            return False

    def events(self, reason: str) -> list[str]:
        items = self.cluster.admin.get(f"/api/v1/namespaces/{self.ns}/events")["items"]
        return sorted(
            e["message"] for e in items if e["reason"] == reason and e["involvedObject"]["name"] == NAME
        )

    def get(self) -> dict[str, Any]:
        return self.cluster.admin.get(self.path)

    def router_url(self, timeout_s: float = 600) -> str:
        def ready() -> dict[str, Any] | None:
            found = self.pods("router")
            return found[0] if len(found) == 1 and is_ready(found[0]) else None

        return http_url(
            wait_for(ready, timeout=timeout_s, interval=1, message="the router Ready"), "/v1/completions"
        )


def post(url: str) -> httpx.Response:
    return httpx.post(url, json=BODY, timeout=900, trust_env=False)


@dataclass(frozen=True)
class ColdStart:
    """One request sent while every pool was at zero."""

    status: int
    text: str
    woken_after_s: float  # the autoscaler's wake-up Events were there
    ready_after_s: float  # both pools had a Ready pod
    answered_after_s: float  # the cold start


def cold_start(res: ZeroDeployment, url: str) -> ColdStart:
    """Send one request to a deployment at zero and time the way to its answer."""
    woken_before = len(res.events("ScaledUp"))
    with ThreadPoolExecutor(1) as pool:
        sent = time.monotonic()
        answer = pool.submit(post, url)
        wait_for(
            lambda: len(res.events("ScaledUp")) >= woken_before + 2,
            timeout=120,
            interval=0.2,
            message="the wake-up",
        )
        woken = time.monotonic() - sent
        wait_for(
            lambda: res.serving() or answer.done(), timeout=900, interval=0.2, message="both pools Ready"
        )
        ready = time.monotonic() - sent
        response = answer.result()
    answered = time.monotonic() - sent
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
    return ColdStart(response.status_code, text, woken, min(ready, answered), answered)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_floor() -> float:
    """A standalone `baton-engine serve` with the pods' engine flags: start to /ready, seconds."""
    port = _free_port()
    argv = [
        str(Path(sys.executable).with_name("baton-engine")), "serve", "--model", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", str(ENGINE["maxModelLen"]), "--num-kv-blocks", str(ENGINE["numKvBlocks"]),
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        with httpx.Client(timeout=5, trust_env=False) as client:

            def ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"baton-engine serve exited {proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    return client.get(f"http://127.0.0.1:{port}{contract.PATH_READY}").status_code == 200
                return False

            wait_for(ready, timeout=600, interval=0.1, message="the standalone engine Ready")
        return time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def cluster_at(cluster_dir: Path | None) -> Iterator[DevCluster]:
    if cluster_dir is not None:
        cluster = DevCluster.attach(ClusterState.load(cluster_dir))
        try:
            yield cluster
        finally:
            cluster.close()
        return
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        state = start_cluster(ClusterSpec(name="bench", kwok_nodes=0, process_nodes=1), find_binaries(),
                              directory=Path(tmp) / "cluster")  # fmt: skip
        cluster = DevCluster.attach(state)
        try:
            yield cluster
        finally:
            cluster.close()
            stop_cluster(state)


def run(config: Config, cluster_dir: Path | None) -> dict[str, Any]:
    floors: list[float] = []
    with cluster_at(cluster_dir) as cluster, tempfile.TemporaryDirectory(prefix="baton-bench-op-") as work:
        with (
            cluster_operator(cluster, Path(work), "--no-peering"),
            cluster.namespace(f"bench-cold-start-{uuid.uuid4().hex[:4]}") as ns,
        ):
            res = ZeroDeployment(cluster, ns)
            res.create(config)
            url = res.router_url()
            starts = []
            for i in range(config.runs):
                wait_for(res.at_zero, timeout=900, interval=1, message="every pool at zero")
                # The floor next to each cold start: a shared machine's load changes by the minute.
                floors.append(engine_floor())
                result = cold_start(res, url)
                if result.status != 200:
                    raise RuntimeError(f"run {i}: HTTP {result.status}: {result.text}")
                starts.append(result)
                print(f"run {i + 1}/{config.runs}: {result}, floor {floors[-1]:.2f} s", file=sys.stderr)
            cluster.admin.delete(res.path)
    answered = [s.answered_after_s for s in starts]
    cold = statistics.median(answered)
    return {
        "bench": "cold_start",
        "cold_start_s": round(cold, 2),
        "cold_start_runs_s": [round(a, 2) for a in answered],
        "woken_after_s": round(statistics.median(s.woken_after_s for s in starts), 2),
        "ready_after_s": round(statistics.median(s.ready_after_s for s in starts), 2),
        "engine_floor_s": round(statistics.median(floors), 2),
        "engine_floor_runs_s": [round(f, 2) for f in floors],
        "orchestration_s": round(statistics.median(a - f for a, f in zip(answered, floors, strict=True)), 2),
        "orchestration_runs_s": [round(a - f, 2) for a, f in zip(answered, floors, strict=True)],
        "config": asdict(config),
        "machine": f"{os.cpu_count()} CPUs",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--runs", type=int, default=FULL.runs, help="cold starts to time (the median is reported)"
    )
    parser.add_argument("--cluster-dir", type=Path, default=None, help="a running local cluster to use")
    parser.add_argument("--quick", action="store_true", help="one cold start: a smoke run")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config(FULL.idle_s, FULL.hold_queue, args.runs)
    result = {**run(config, args.cluster_dir), "quick": args.quick}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
