"""A bare control plane for CRD tests: etcd + kube-apiserver only, free loopback ports, a temp dir.

Nothing is scheduled (no scheduler, no nodes); enough for admission, validation, RBAC and
server-side apply. A module may add a kube-controller-manager running only the controllers it
names (`controllers`: e.g. the garbage collector and the Deployment and ReplicaSet controllers,
so that deleting an owner deletes its children and Deployments get pods). Processes are started
and stopped by pid. The fuller local cluster (process nodes, kwok) comes from the devcluster
harness.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from baton_support.ports import free_port

BIN_ROOT = Path.home() / ".cache/baton/k8s-bin"
ADMIN_TOKEN = "admin-token"


def binary_dir() -> Path | None:
    """The newest build directory holding etcd and kube-apiserver, if any."""
    override = os.environ.get("BATON_K8S_BIN")
    candidates = [Path(override)] if override else sorted(BIN_ROOT.glob("k8s-*"), reverse=True)
    for path in candidates:
        if (path / "etcd").is_file() and (path / "kube-apiserver").is_file():
            return path
    return None


@dataclass(frozen=True)
class ApiServer:
    url: str
    token: str
    ca_file: Path
    workdir: Path

    def kubeconfig(self) -> Path:
        path = self.workdir / "admin.kubeconfig"
        return write_kubeconfig(path, self.url, self.ca_file, self.token)


def write_kubeconfig(path: Path, url: str, ca_file: Path, token: str, user: str = "admin") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "t", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _write_pki(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def pem_key(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    now = dt.datetime.now(dt.UTC)
    ca_key, srv_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baton-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.crt").write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.key").write_bytes(pem_key(srv_key))
    (d / "sa.key").write_bytes(pem_key(sa_key))
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (d / "tokens.csv").write_text(
        f'{ADMIN_TOKEN},admin,u1,"system:masters"\noperator-token,baton-operator,u2,"baton"\n'
    )


def _wait(
    check_url: str,
    deadline_s: float,
    proc: subprocess.Popen[bytes],
    ctx: ssl.SSLContext | None,
    token: str | None = None,
) -> None:
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {check_url} answered")
        req = urllib.request.Request(check_url)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{check_url} not healthy after {deadline_s}s: {last}")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15) -> bool:
    """SIGTERM, then SIGKILL after `grace_s`; True when it had to be killed (a running process)."""
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
    return False


def _controller_manager(
    server: ApiServer, bin_dir: Path, controllers: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    """kube-controller-manager running `controllers` against `server`, once its /healthz answers."""
    port = free_port()
    with open(server.workdir / "controller-manager.log", "wb") as log:
        kcm = subprocess.Popen(
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={server.kubeconfig()}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--controllers={','.join(controllers)}",
                "--use-service-account-credentials=false",
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                "--profiling=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    # /healthz of the controller manager needs no credentials; its certificate is self-signed.
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    try:
        _wait(f"https://127.0.0.1:{port}/healthz", 120, kcm, insecure)
    except BaseException:
        stop_process(kcm)
        raise
    return kcm


@contextmanager
def api_server(workdir: Path, bin_dir: Path, controllers: tuple[str, ...] = ()) -> Iterator[ApiServer]:
    """Start etcd and kube-apiserver under `workdir` (and kube-controller-manager running only
    `controllers`, when any are named); stop them (by pid) on exit."""
    _write_pki(workdir)
    client_port, peer_port, api_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(workdir / "etcd.log", "wb") as etcd_log:
            etcd = subprocess.Popen(
                [
                    str(bin_dir / "etcd"),
                    f"--data-dir={workdir / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{client_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                    "--unsafe-no-fsync",
                ],
                stdout=etcd_log,
                stderr=subprocess.STDOUT,
            )
        procs.append(etcd)
        _wait(f"http://127.0.0.1:{client_port}/health", 120, etcd, None)
        with open(workdir / "apiserver.log", "wb") as api_log:
            api = subprocess.Popen(
                [
                    str(bin_dir / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{client_port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={api_port}",
                    f"--tls-cert-file={workdir / 'apiserver.crt'}",
                    f"--tls-private-key-file={workdir / 'apiserver.key'}",
                    f"--client-ca-file={workdir / 'ca.crt'}",
                    f"--token-auth-file={workdir / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-account-key-file={workdir / 'sa.pub'}",
                    f"--service-account-signing-key-file={workdir / 'sa.key'}",
                    "--service-cluster-ip-range=198.19.0.0/24",
                    "--endpoint-reconciler-type=none",
                    "--disable-admission-plugins=ServiceAccount",
                    f"--cert-dir={workdir / 'certs'}",
                ],
                stdout=api_log,
                stderr=subprocess.STDOUT,
            )
        procs.append(api)
        ctx = ssl.create_default_context(cafile=str(workdir / "ca.crt"))
        url = f"https://127.0.0.1:{api_port}"
        _wait(f"{url}/readyz", 120, api, ctx, ADMIN_TOKEN)
        server = ApiServer(url=url, token=ADMIN_TOKEN, ca_file=workdir / "ca.crt", workdir=workdir)
        if controllers:
            procs.append(_controller_manager(server, bin_dir, controllers))
        yield server
    finally:
        for proc in reversed(procs):
            stop_process(proc)


class Rest:
    """Plain REST calls to a test API server (any kind, any verb), JSON in and out."""

    def __init__(self, server: ApiServer, token: str | None = None) -> None:
        self.url = server.url
        self.token = token or server.token
        self.ctx = ssl.create_default_context(cafile=str(server.ca_file))

    def call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Content-Type", content_type)
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str) -> dict[str, Any]:
        status, body = self.call("GET", path)
        assert status == 200, (path, status, body)
        return body
