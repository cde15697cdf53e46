"""Command lines of the control plane's processes (flags per devcluster's recipe)."""

from __future__ import annotations

import sys
from pathlib import Path

from baton_dev import spec as names
from baton_dev.binaries import Binaries
from baton_dev.pki import ClusterPki
from baton_dev.spec import ClusterSpec


def component_argv(
    binaries: Binaries, spec: ClusterSpec, directory: Path, pki: ClusterPki, ports: dict[str, int]
) -> dict[str, list[str]]:
    admin_kc = str(directory / "admin.kubeconfig")
    b = binaries.path
    argv = {
        "etcd": [
            str(b("etcd")),
            "--name=default",
            f"--data-dir={directory / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{ports['etcd_peer']}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(b("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={directory / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--enable-admission-plugins=PodSecurity",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={names.SERVICE_CIDR}",
            # The `kubernetes` Endpoints would hold 127.0.0.1, which validation rejects.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
        ],
        "kube-controller-manager": [
            str(b("kube-controller-manager")),
            f"--kubeconfig={admin_kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['kcm']}",
            "--controllers=*",
            "--allocate-node-cidrs=false",
            f"--root-ca-file={pki.ca_cert}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--use-service-account-credentials={str(spec.use_service_account_credentials).lower()}",
            # Per-controller credentials cost a few requests per controller; the default client
            # rate limit (20 qps) then stretches start-up by seconds.
            "--kube-api-qps=500",
            "--kube-api-burst=1000",
            "--profiling=false",
        ],
        "kube-scheduler": [
            str(b("kube-scheduler")),
            f"--kubeconfig={admin_kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['scheduler']}",
            "--profiling=false",
        ],
        "kwok": [
            str(b("kwok")),
            f"--kubeconfig={admin_kc}",
            f"--config={directory / 'kwok.yaml'}",
            f"--manage-nodes-with-label-selector={names.NODE_TYPE_LABEL}=kwok",
            f"--cidr={names.KWOK_POD_CIDR}",
            "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{ports['kwok']}",
        ],
        "node-agent": [
            sys.executable,
            "-m",
            "baton_dev.node_agent",
            f"--kubeconfig={admin_kc}",
            f"--state-dir={directory / 'agent'}",
            f"--nodes={spec.process_nodes}",
            f"--gpus={spec.process_gpus}",
            f"--backoff-initial={spec.backoff_initial_s}",
            f"--backoff-max={spec.backoff_max_s}",
        ],
    }
    return argv
