"""Start and stop one local control plane: etcd → kube-apiserver → controller-manager and
scheduler → kwok and the process-node agent → nodes Ready. Every process is recorded by pid in
the cluster's state file; logs stay in <dir>/logs."""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from baton_dev import spec as names
from baton_dev.binaries import KWOK_STAGE_FILES, Binaries
from baton_dev.components import component_argv
from baton_dev.health import ComponentFailed, http_ok, wait_until
from baton_dev.kubeapi import ApiAccess, ApiError, KubeApi
from baton_dev.kubeconfig import write_kubeconfig
from baton_dev.pki import write_cluster_pki
from baton_dev.ports import free_ports
from baton_dev.processes import ProcessRecord, is_alive, spawn, start_ticks, stop
from baton_dev.spec import ClusterSpec
from baton_dev.state import ClusterState

Log = Callable[[str], None]


class ClusterAlreadyRunning(RuntimeError):
    pass


def _quiet(_: str) -> None:
    pass


def _write_tokens(directory: Path) -> tuple[str, str]:
    admin, restricted = secrets.token_hex(16), secrets.token_hex(16)
    path = directory / "tokens.csv"
    path.write_text(
        f'{admin},{names.ADMIN_USER},uid-admin,"system:masters"\n'
        f'{restricted},{names.RESTRICTED_USER},uid-restricted,"{names.RESTRICTED_GROUP}"\n'
    )
    path.chmod(0o600)
    return admin, restricted


def _write_kwok_config(binaries: Binaries, path: Path) -> None:
    docs = [(binaries.kwok_stages / f).read_text().strip() for f in KWOK_STAGE_FILES]
    path.write_text("\n---\n".join(docs) + "\n")


def _kwok_node(index: int, gpus: int) -> dict[str, object]:
    name = names.kwok_node_name(index)
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", names.GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                names.NODE_TYPE_LABEL: "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "spec": {
            "podCIDR": f"127.1.{index}.0/24",
            "podCIDRs": [f"127.1.{index}.0/24"],
            "taints": [dict(names.KWOK_TAINT)],
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def _node_ready(node: dict[str, object]) -> bool:
    status = node.get("status") or {}
    spec = node.get("spec") or {}
    assert isinstance(status, dict) and isinstance(spec, dict)
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    tainted = any(t.get("key") == "node.kubernetes.io/not-ready" for t in spec.get("taints") or [])
    return ready and not tainted


START_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "node-agent")


def cluster_dir(name: str) -> Path:
    return names.clusters_home() / name


def start_cluster(
    spec: ClusterSpec,
    binaries: Binaries,
    directory: Path | None = None,
    timeout_s: float = 120.0,
    log: Log = _quiet,
) -> ClusterState:
    """Start every component and return once all nodes are Ready. On failure, stops what it
    started (logs stay) and raises."""
    t0 = time.monotonic()
    directory = directory or cluster_dir(spec.name)
    if (directory / "state.json").exists():
        old = ClusterState.load(directory)
        if any(is_alive(p) for p in old.processes):
            raise ClusterAlreadyRunning(
                f"cluster {old.name!r} is already running in {directory}; "
                f"`baton-dev cluster down --name {old.name}` first"
            )
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "logs").mkdir(parents=True)
    (directory / "agent").mkdir()

    pki = write_cluster_pki(directory / "pki")
    admin_token, restricted_token = _write_tokens(directory)
    port_list = free_ports(6)
    ports = dict(zip(("etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok"), port_list, strict=True))
    server = f"https://127.0.0.1:{ports['apiserver']}"
    write_kubeconfig(directory / "admin.kubeconfig", server, pki.ca_cert, names.ADMIN_USER, admin_token)
    write_kubeconfig(
        directory / "restricted.kubeconfig", server, pki.ca_cert, names.RESTRICTED_USER, restricted_token
    )
    _write_kwok_config(binaries, directory / "kwok.yaml")
    state = ClusterState(
        name=spec.name,
        directory=directory,
        bin_dir=binaries.directory,
        server=server,
        ports=ports,
        spec=spec.to_json(),
    )
    state.save()
    argv = component_argv(binaries, spec, directory, pki, ports)
    access = ApiAccess(server, pki.ca_cert, admin_token)

    def launch(name: str) -> ProcessRecord:
        record = spawn(name, argv[name], directory / "logs" / f"{name}.log")
        state.processes.append(record)
        state.save()
        return record

    try:
        etcd = launch("etcd")
        wait_until("etcd /health", http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), 30, etcd)
        log(f"etcd healthy after {time.monotonic() - t0:.1f} s")
        apiserver = launch("kube-apiserver")
        # The scheduler waits for the API server itself: starting it now overlaps its start-up
        # with the API server's. The controller manager gives up (exits) when the API server's
        # /healthz is not OK within 10 s of its start, which a loaded machine exceeds (the RBAC
        # bootstrap hook): it starts once the API server is ready.
        scheduler = launch("kube-scheduler")
        wait_until(
            "kube-apiserver /readyz",
            http_ok(f"{server}/readyz", ca_file=str(pki.ca_cert), token=admin_token),
            timeout_s,
            apiserver,
        )
        log(f"kube-apiserver ready after {time.monotonic() - t0:.1f} s")
        kcm = launch("kube-controller-manager")
        kwok = launch("kwok") if spec.kwok_nodes else None
        agent = launch("node-agent") if spec.process_nodes else None
        with KubeApi(access) as api:
            for i in range(spec.kwok_nodes):
                api.post("/api/v1/nodes", _kwok_node(i, spec.kwok_gpus))
            wait_until(
                "kube-controller-manager /healthz",
                http_ok(f"https://127.0.0.1:{ports['kcm']}/healthz"),
                timeout_s,
                kcm,
            )
            wait_until(
                "kube-scheduler /healthz",
                http_ok(f"https://127.0.0.1:{ports['scheduler']}/healthz"),
                timeout_s,
                scheduler,
            )
            if kwok:
                wait_until(
                    "kwok /healthz", http_ok(f"http://127.0.0.1:{ports['kwok']}/healthz"), timeout_s, kwok
                )
            expected = spec.kwok_nodes + spec.process_nodes

            def nodes_ready() -> bool:
                for record in (kwok, agent):
                    if record and not is_alive(record):
                        raise ComponentFailed(f"{record.name} exited; see {record.log}")
                items = api.get("/api/v1/nodes")["items"]
                return len(items) == expected and all(_node_ready(n) for n in items)

            wait_until(f"{expected} nodes Ready and untainted", nodes_ready, timeout_s)
            log(f"nodes ready after {time.monotonic() - t0:.1f} s")

            def default_service_account() -> bool:
                try:
                    api.get("/api/v1/namespaces/default/serviceaccounts/default")
                    return True
                except ApiError as e:
                    if e.status == 404:
                        return False
                    raise

            wait_until("the default ServiceAccount", default_service_account, timeout_s, kcm)
    except BaseException:
        stop_cluster(state)
        raise
    state.ready_s = round(time.monotonic() - t0, 3)
    state.save()
    log(f"cluster {spec.name!r} ready after {state.ready_s:.1f} s")
    return state


def leftover_pod_processes(state: ClusterState) -> list[ProcessRecord]:
    """Pod processes the node agent recorded and has not yet reaped (pid files <pid>.pid holding
    the start ticks)."""
    records = []
    for pid_file in sorted((state.agent_dir / "pids").glob("*.pid")):
        try:
            pid, ticks = int(pid_file.stem), int(pid_file.read_text().strip())
        except (ValueError, OSError):
            continue
        records.append(ProcessRecord(name=f"pod-process-{pid}", pid=pid, start_ticks=ticks, log=""))
    return records


def stop_cluster(state: ClusterState) -> list[str]:
    """Stop every recorded process (agent first, etcd last), then any pod process the agent left.
    Returns the names of the processes that were still running."""
    stopped = []
    order = {name: i for i, name in enumerate(START_ORDER)}
    for record in sorted(state.processes, key=lambda p: -order.get(p.name, 0)):
        if stop(record, grace_s=15.0 if record.name == "node-agent" else 5.0):
            stopped.append(record.name)
    for record in leftover_pod_processes(state):
        if stop(record, grace_s=1.0):
            stopped.append(record.name)
    return stopped


def component_status(state: ClusterState) -> dict[str, str]:
    """'running (pid N)' or 'not running' per recorded component."""
    return {
        p.name: f"running (pid {p.pid})" if start_ticks(p.pid) == p.start_ticks else "not running"
        for p in state.processes
    }
