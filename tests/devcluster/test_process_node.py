"""Process nodes: pods run as local processes on their loopback pod IP, with env, probes,
restart back-off and graceful termination, all reported through the pod's status."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton_dev.node_agent.pod_range import FIRST_OCTET, claim_pod_range
from baton_dev.testing import DevCluster, condition, is_ready
from baton_support.wait import wait_for
from tests.devcluster.pods import run_to_completion

pytestmark = pytest.mark.k8s
SERVER = str(Path(__file__).parent / "data" / "podserver.py")


def _server_pod(name: str, **extra: Any) -> dict[str, Any]:
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PORT", "value": "8080"},
        *extra.pop("env", []),
    ]
    container = {
        "name": "server",
        "image": "python:3.11",
        "command": ["python", SERVER],
        "env": env,
        "ports": [{"name": "http", "containerPort": 8080}],
        **extra.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"type": "process"}, "containers": [container], **extra},
    }


def _running_ip(dev_cluster: DevCluster, ns: str, name: str) -> str:
    def serving() -> str | None:
        pod = dev_cluster.pod(ns, name)
        ip = pod["status"].get("podIP")
        if pod["status"].get("phase") != "Running" or not ip:
            return None
        try:
            return str(ip) if httpx.get(f"http://{ip}:8080/healthz", timeout=1).status_code == 200 else None
        except httpx.HTTPError:
            return None

    return wait_for(serving, timeout=30, interval=0.1, message=f"{name} to serve on its pod IP")


def test_env_and_service_account_kubeconfig(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    api = dev_cluster.admin
    api.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "cfg"}, "data": {"mode": "fast"}})
    api.post(
        f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": "sec"}, "stringData": {"key": "s3cret"}}
    )
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "key"}}},
        {"name": "URL", "value": "http://$(POD_IP):$(PORT)/x"},
    ]
    api.post(
        f"/api/v1/namespaces/{ns}/pods",
        _server_pod(
            "env", env=env, container={"envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}]}
        ),
    )
    ip = _running_ip(dev_cluster, ns, "env")
    node = api.get(f"/api/v1/nodes/{dev_cluster.pod(ns, 'env')['spec']['nodeName']}")
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(node["spec"]["podCIDR"])
    seen = httpx.get(f"http://{ip}:8080/env", timeout=30).json()
    assert {
        k: seen[k] for k in ("POD_IP", "POD_NAME", "POD_NAMESPACE", "MODE", "SECRET", "URL", "CFG_mode")
    } == {
        "POD_IP": ip,
        "POD_NAME": "env",
        "POD_NAMESPACE": ns,
        "MODE": "fast",
        "SECRET": "s3cret",
        "URL": f"http://{ip}:8080/x",
        "CFG_mode": "fast",
    }
    assert seen["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert seen["KUBERNETES_SERVICE_PORT"] == str(dev_cluster.state.ports["apiserver"])
    # The kubeconfig holds a bound token of the pod's service account, minted by TokenRequest.
    with open(seen["KUBECONFIG"]) as f:
        kubeconfig = f.read()
    assert "user: system:serviceaccount:default" in kubeconfig
    review = api.post(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        {"spec": {"token": Path(seen["KUBECONFIG"]).with_name("token").read_text()}},
    )
    assert review["status"]["user"]["username"] == f"system:serviceaccount:{ns}:default"
    assert review["status"]["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["env"]


def test_ready_only_when_readiness_probe_passes(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}
    dev_cluster.admin.post(
        f"/api/v1/namespaces/{ns}/pods", _server_pod("web", container={"readinessProbe": probe})
    )
    ip = _running_ip(dev_cluster, ns, "web")

    # Serving, but /ready answers 503: after three failed probes it must still be unready.
    wait_for(
        lambda: len(dev_cluster.agent_events(ns, "web", "probe-failed")) >= 3,
        timeout=30,
        interval=0.1,
        message="3 failed readiness probes",
    )
    pod = dev_cluster.pod(ns, "web")
    assert not is_ready(pod)
    assert condition(pod, "ContainersReady")["status"] == "False"  # type: ignore[index]
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    assert "statuscode: 503" in dev_cluster.agent_events(ns, "web", "probe-failed")[-1]["message"]

    assert httpx.post(f"http://{ip}:8080/make-ready", timeout=30).status_code == 200

    def ready_pod() -> dict[str, Any] | None:
        pod = dev_cluster.pod(ns, "web")
        return pod if is_ready(pod) else None

    pod = wait_for(ready_pod, timeout=30, interval=0.1, message="the pod to turn Ready")
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    assert pod["status"]["podIP"] == ip
    assert pod["status"]["podIPs"] == [{"ip": ip}]
    assert pod["status"]["hostIP"] == "127.0.0.1"


def test_killed_process_restarts_with_growing_backoff(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", _server_pod("crashy"))
    for restarts in range(3):
        ip = _running_ip(dev_cluster, ns, "crashy")
        pid = int(httpx.get(f"http://{ip}:8080/pid", timeout=30).text)
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda n=restarts: (
                dev_cluster.pod(ns, "crashy")["status"]["containerStatuses"][0]["restartCount"] == n + 1
            ),
            timeout=30,
            interval=0.1,
            message=f"restart {restarts + 1}",
        )
    _running_ip(dev_cluster, ns, "crashy")

    # Delay from each exit to the next start, from the agent's own records (kubelet-like: the
    # first restart is immediate, then 1 s, 2 s with this cluster's back-off settings).
    exits = [e["time"] for e in dev_cluster.agent_events(ns, "crashy", "exited")]
    starts = [e["time"] for e in dev_cluster.agent_events(ns, "crashy", "started")]
    assert len(exits) == 3 and len(starts) == 4
    delays = [start - exit for exit, start in zip(exits, starts[1:], strict=True)]
    # Lower bounds are exact (the agent sleeps at least the back-off); upper bounds leave room
    # for a loaded 2-core machine while still telling 0, 1 and 2 s apart.
    assert delays[0] < 0.9
    assert 1.0 <= delays[1] < 2.0
    assert 2.0 <= delays[2] < 3.5
    scheduled = [e["delay_s"] for e in dev_cluster.agent_events(ns, "crashy", "restart-scheduled")]
    assert scheduled == [0.0, 1.0, 2.0]

    status = dev_cluster.pod(ns, "crashy")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 3
    assert status["lastState"]["terminated"]["exitCode"] == 137
    assert status["lastState"]["terminated"]["signal"] == 9
    assert "running" in status["state"]


def test_delete_sends_sigterm_then_sigkill_after_grace(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    pod = _server_pod(
        "stubborn", env=[{"name": "IGNORE_SIGTERM", "value": "1"}], terminationGracePeriodSeconds=2
    )
    dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", pod)
    ip = _running_ip(dev_cluster, ns, "stubborn")
    pid = int(httpx.get(f"http://{ip}:8080/pid", timeout=30).text)

    dev_cluster.admin.delete(f"/api/v1/namespaces/{ns}/pods/stubborn")
    wait_for(
        lambda: not dev_cluster.exists(f"/api/v1/namespaces/{ns}/pods/stubborn"),
        timeout=30,
        interval=0.1,
        message="the pod object to go",
    )

    sigterm = dev_cluster.agent_events(ns, "stubborn", "sigterm")
    sigkill = dev_cluster.agent_events(ns, "stubborn", "sigkill")
    exited = dev_cluster.agent_events(ns, "stubborn", "exited")
    assert [e["pid"] for e in sigterm] == [pid] and sigterm[0]["grace_s"] == 2.0
    assert [e["pid"] for e in sigkill] == [pid]
    assert exited[-1]["returncode"] == -9
    assert 2.0 <= sigkill[0]["time"] - sigterm[0]["time"] < 3.0
    # The process itself saw the SIGTERM (and ignored it) before it was killed.
    got = [
        line for line in dev_cluster.pod_log(ns, "stubborn", "server").splitlines() if "got SIGTERM" in line
    ]
    assert len(got) == 1
    received = float(got[0].rsplit(" ", 1)[1])
    assert sigterm[0]["time"] <= received < sigkill[0]["time"]
    assert not Path(f"/proc/{pid}").exists()


def test_delete_of_cooperative_process_needs_no_sigkill(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    dev_cluster.admin.post(
        f"/api/v1/namespaces/{ns}/pods", _server_pod("polite", terminationGracePeriodSeconds=30)
    )
    _running_ip(dev_cluster, ns, "polite")
    dev_cluster.kubectl("delete", "pod", "polite", "-n", ns, "--wait=true", "--timeout=20s")
    assert [
        e["event"] for e in dev_cluster.agent_events(ns, "polite") if e["event"] in ("sigterm", "sigkill")
    ] == ["sigterm"]
    assert dev_cluster.agent_events(ns, "polite", "exited")[-1]["returncode"] == 0

    def reasons() -> set[tuple[str, str]]:
        events = json.loads(dev_cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        return {(e["reason"], e["involvedObject"]["name"]) for e in events}

    # The agent posts Events from background tasks: "Killing" may land after the pod is gone.
    wait_for(
        lambda: {("Started", "polite"), ("Killing", "polite")} <= reasons(),
        timeout=30,
        interval=0.1,
        message="the Started and Killing Events",
    )


def test_init_container_then_console_script(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    pod = run_to_completion(
        dev_cluster,
        ns,
        "job",
        # A console script of the agent's Python environment, found through PATH.
        [{"name": "main", "image": "x", "command": ["baton-dev", "cluster", "--help"]}],
        init_containers=[{"name": "prepare", "image": "x", "command": ["python", "-c", "print('prepared')"]}],
    )
    assert pod["status"]["phase"] == "Succeeded"
    assert condition(pod, "Initialized")["status"] == "True"  # type: ignore[index]
    init = pod["status"]["initContainerStatuses"][0]["state"]["terminated"]
    main = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (init["exitCode"], init["reason"], main["exitCode"], main["reason"]) == (
        0,
        "Completed",
        0,
        "Completed",
    )
    assert dev_cluster.pod_log(ns, "job", "prepare") == "prepared\n"
    assert dev_cluster.pod_log(ns, "job", "main").startswith("usage: baton-dev cluster")
    assert [e["container"] for e in dev_cluster.agent_events(ns, "job", "started")] == ["prepare", "main"]


def test_failed_init_container_fails_a_never_restart_pod(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    pod = run_to_completion(
        dev_cluster,
        ns,
        "broken",
        [{"name": "main", "image": "x", "command": ["python", "-c", "pass"]}],
        init_containers=[{"name": "prepare", "image": "x", "command": ["python", "-c", "exit(3)"]}],
    )
    assert pod["status"]["phase"] == "Failed"
    assert condition(pod, "Initialized")["reason"] == "ContainersNotInitialized"  # type: ignore[index]
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    assert pod["status"]["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert [e["container"] for e in dev_cluster.agent_events(ns, "broken", "started")] == ["prepare"]


def test_liveness_probe_failure_restarts_after_startup_probe(
    dev_cluster: DevCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    # Liveness: an exec probe (run in the pod's working dir) that logs each run to probes.log and
    # passes only once the file "alive" exists.
    check = (
        "import os, sys; open('probes.log', 'a').write('x\\n'); sys.exit(0 if os.path.exists('alive') else 1)"
    )
    liveness = {"exec": {"command": ["python", "-c", check]}, "periodSeconds": 1, "failureThreshold": 2}
    startup = {"tcpSocket": {"port": "http"}, "periodSeconds": 1, "failureThreshold": 30}
    pod = _server_pod(
        "lively",
        container={"livenessProbe": liveness, "startupProbe": startup},
        terminationGracePeriodSeconds=5,
    )
    dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", pod)

    def container_status() -> dict[str, Any]:
        statuses = dev_cluster.pod(ns, "lively")["status"].get("containerStatuses") or [{}]
        return dict(statuses[0])

    wait_for(
        lambda: container_status().get("restartCount", 0) >= 1,
        timeout=30,
        interval=0.1,
        message="a liveness restart",
    )
    failures = [e for e in dev_cluster.agent_events(ns, "lively", "probe-failed") if e["probe"] == "Liveness"]
    assert len(failures) >= 2
    assert "exited with 1" in failures[0]["message"]
    first_exit = dev_cluster.agent_events(ns, "lively", "exited")[0]
    assert first_exit["returncode"] == 0  # the server ended itself on the SIGTERM it was sent
    assert dev_cluster.agent_events(ns, "lively", "sigterm")[0]["pid"] == first_exit["pid"]
    # In the first run, liveness only started after the startup probe had passed.
    startup_failures = [
        e for e in dev_cluster.agent_events(ns, "lively", "probe-failed") if e["probe"] == "Startup"
    ]
    first_run = [e for e in startup_failures if e["time"] < first_exit["time"]]
    assert all(e["time"] < failures[0]["time"] for e in first_run)

    # Once the probe passes, the restarts stop.
    pod_dir = next((dev_cluster.state.agent_dir / "pods").glob(f"{ns}_lively_*"))
    (pod_dir / "alive").write_text("yes")
    ip = _running_ip(dev_cluster, ns, "lively")
    wait_for(lambda: container_status()["started"], timeout=30, interval=0.1, message="started")
    count = container_status()["restartCount"]
    pid = int(httpx.get(f"http://{ip}:8080/pid", timeout=30).text)
    runs = len((pod_dir / "probes.log").read_text().splitlines())
    wait_for(
        lambda: len((pod_dir / "probes.log").read_text().splitlines()) >= runs + 3,
        timeout=30,
        interval=0.1,
        message="3 more liveness probes",
    )
    assert container_status()["restartCount"] == count
    assert int(httpx.get(f"http://{ip}:8080/pid", timeout=30).text) == pid


def test_container_exit_ends_its_child_processes(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    # The main process starts a long-lived child, reports its pid, then exits.
    script = (
        "import subprocess, sys; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(child.pid, flush=True)"
    )
    main = {"name": "main", "image": "x", "command": ["python", "-c", script]}
    pod = run_to_completion(dev_cluster, ns, "parent", [main])
    assert pod["status"]["phase"] == "Succeeded"
    child = int(dev_cluster.pod_log(ns, "parent", "main").strip())
    wait_for(
        lambda: not Path(f"/proc/{child}").exists() or _zombie(child),
        timeout=30,
        interval=0.1,
        message="the orphaned child to be gone",
    )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_another_cluster_gets_another_pod_range(dev_cluster: DevCluster) -> None:
    """The range a second cluster's agent would claim now, beside this running one."""
    node = dev_cluster.admin.get("/api/v1/nodes", labelSelector="type=process")["items"][0]
    running = ipaddress.ip_network(node["spec"]["podCIDR"])
    assert running.prefixlen == 24 and running.network_address.packed[1] >= FIRST_OCTET
    with claim_pod_range() as second:
        assert not second.network.overlaps(running)
