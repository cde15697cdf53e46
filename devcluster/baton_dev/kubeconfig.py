"""Kubeconfig files for bearer-token users of the local cluster."""

from __future__ import annotations

from pathlib import Path

import yaml


def kubeconfig_document(server: str, ca_file: Path, user: str, token: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "baton-dev", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "baton-dev", "user": user}}],
        "current-context": user,
    }


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, token: str) -> Path:
    path.write_text(yaml.safe_dump(kubeconfig_document(server, ca_file, user, token), sort_keys=False))
    path.chmod(0o600)
    return path
