"""The operator as a real process against a test API server, with the chart's RBAC.

Installs what `helm install` would (the chart's crds/ and rendered templates) through the admin
REST API, mints a token for the chart's ServiceAccount (TokenRequest) and runs `baton-operator
run` as that ServiceAccount. Started and stopped by pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from baton_operator import models
from baton_operator.kube import collection_path
from baton_support.apiserver import ApiServer, Rest, stop_process, write_kubeconfig
from baton_support.ports import free_port
from baton_support.wait import wait_for

if TYPE_CHECKING:
    from baton_dev.testing import DevCluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts/baton"
RELEASE, OPERATOR_NS = "baton", "baton-system"
CLUSTER_PATHS = {
    "Namespace": "/api/v1/namespaces",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "ClusterKopfPeering": "/apis/kopf.dev/v1/clusterkopfpeerings",
}


def helm_template(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", RELEASE, str(CHART), "-n", OPERATOR_NS, *(f"--set={s}" for s in sets)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def create(rest: Rest, manifest: dict[str, Any]) -> None:
    kind = manifest["kind"]
    if kind in CLUSTER_PATHS:
        path = CLUSTER_PATHS[kind]
    elif kind == "KopfPeering":  # Kopf's own kind: not one the operator's client writes
        path = f"/apis/kopf.dev/v1/namespaces/{manifest['metadata']['namespace']}/kopfpeerings"
    else:
        path = collection_path(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["namespace"])
    status, body = rest.call("POST", path, manifest)
    if status not in (201, 409):
        raise RuntimeError(f"creating {kind} {manifest['metadata']['name']}: HTTP {status} {body}")


def established(crd: Mapping[str, Any]) -> bool:
    """Whether the API server serves a CRD's kind: its Established condition is True."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def wait_established(rest: Rest, crd_name: str, timeout_s: float = 30) -> None:
    path = f"{CLUSTER_PATHS['CustomResourceDefinition']}/{crd_name}"
    message = f"the CRD {crd_name} to be Established"
    wait_for(lambda: established(rest.get(path)), timeout=timeout_s, interval=0.1, message=message)


def install_chart(rest: Rest, helm: Path, *sets: str) -> str:
    """Apply the chart's CRDs and templates (values `sets`, e.g. ``watchNamespaces={llm}``: the
    namespaces they name are created too); return the operator ServiceAccount's name."""
    create(rest, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}})
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            create(rest, crd)
            wait_established(rest, crd["metadata"]["name"])
    docs = helm_template(helm, *sets)
    for namespace in sorted(
        {d["metadata"]["namespace"] for d in docs if d["kind"] in ("Role", "KopfPeering")}
    ):
        create(rest, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    order = [
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ClusterKopfPeering",
        "KopfPeering",
    ]  # fmt: skip
    for kind in order:
        for doc in docs:
            if doc["kind"] == kind:
                create(rest, doc)
    (sa,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
    return str(sa)


def service_account_token(rest: Rest, namespace: str, name: str) -> str:
    path = collection_path("v1", "ServiceAccount", namespace) + f"/{name}/token"
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600},
    }
    status, body = rest.call("POST", path, request)
    assert status == 201, body
    return str(body["status"]["token"])


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    metrics_url: str
    health_url: str
    log: Path

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as resp:
            return str(resp.read().decode())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def operator_process(
    kubeconfig: Path,
    workdir: Path,
    *extra: str,
    python: Path | None = None,
    module: str = "baton_operator.cli",
    env_extra: dict[str, str] | None = None,
    namespace: str | None = None,
) -> Iterator[OperatorProcess]:
    metrics_port, health_port = free_port(), free_port()
    log = workdir / f"operator-{metrics_port}.log"
    env_extra = {"PYTHONPATH": str(REPO), **(env_extra or {})}
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": OPERATOR_NS, **(env_extra or {})}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    args = [
        str(python or sys.executable), "-m", module, "run",
        f"--namespace={namespace}" if namespace else "--all-namespaces",
        "--bind=127.0.0.1", f"--metrics-port={metrics_port}", f"--health-port={health_port}", *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    handle = OperatorProcess(
        proc, f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{health_port}/healthz", log
    )
    try:
        deadline = time.monotonic() + 180  # a fresh interpreter importing Kopf on a loaded machine
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited with {proc.returncode}:\n{handle.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(handle.health_url, timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"operator liveness never answered:\n{handle.log_text()[-4000:]}")
            time.sleep(0.2)
        yield handle
    finally:
        if proc.poll() is None:
            if stop_process(proc, grace_s=20):
                raise AssertionError(
                    f"the operator did not stop within 20 s of SIGTERM:\n{handle.log_text()[-4000:]}"
                )
            if sys.exc_info()[1] is None:  # never hide the test's own failure behind this one
                assert_clean_stop(handle)


@contextmanager
def cluster_operator(
    cluster: DevCluster, workdir: Path, *extra: str, namespace: str | None = None
) -> Iterator[OperatorProcess]:
    """`operator_process` on a `baton_dev` cluster, as its admin, once the committed CRD is
    applied and Established."""
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    # Not `kubectl wait --for=condition=Established`: it fails at once ("accessor error") when it
    # reads the CRD before the API server has written any condition.
    path = f"{CLUSTER_PATHS['CustomResourceDefinition']}/{models.PLURAL}.{models.GROUP}"
    message = "the CRD to be Established"
    wait_for(lambda: established(cluster.admin.get(path)), timeout=60, interval=0.1, message=message)
    with operator_process(cluster.state.admin_kubeconfig, workdir, *extra, namespace=namespace) as proc:
        yield proc


#: What a clean shutdown never logs: tracebacks, and clients left open (aiohttp's warnings).
UNCLEAN = ("Traceback", "Unclosed client session", "Unclosed connector", "Session is closed")


def assert_clean_stop(handle: OperatorProcess) -> None:
    """After SIGTERM: exit status 0 and nothing of UNCLEAN logged from the signal on."""
    log = handle.log_text()
    after = log[log.find("Signal SIGTERM is received") :] if "Signal SIGTERM is received" in log else log
    found = [marker for marker in UNCLEAN if marker in after]
    if handle.proc.returncode != 0 or found:
        raise AssertionError(
            f"unclean operator shutdown (exit {handle.proc.returncode}, logged {found}):\n{after[-4000:]}"
        )


def operator_kubeconfig(server: ApiServer, rest: Rest, sa: str, path: Path) -> tuple[Path, str]:
    token = service_account_token(rest, OPERATOR_NS, sa)
    return write_kubeconfig(path, server.url, server.ca_file, token, user=sa), token
