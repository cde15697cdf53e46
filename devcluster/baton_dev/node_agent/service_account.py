"""A pod's service-account credentials: a bound token from the TokenRequest API, written as the
files a pod would see (token, ca.crt, namespace) plus a kubeconfig for $KUBECONFIG."""

from __future__ import annotations

import shutil
from pathlib import Path

from baton_dev.kubeapi import ApiAccess, AsyncKubeApi, JsonObject
from baton_dev.kubeconfig import write_kubeconfig

TOKEN_LIFETIME_S = 24 * 3600


def service_account_name(pod: JsonObject) -> str:
    return str(pod["spec"].get("serviceAccountName") or "default")


async def mint_token(api: AsyncKubeApi, pod: JsonObject) -> str:
    """A token bound to this pod (it stops working when the pod is deleted)."""
    meta = pod["metadata"]
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": TOKEN_LIFETIME_S,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        },
    }
    path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{service_account_name(pod)}/token"
    response = await api.post(path, body)
    return str(response["status"]["token"])


def write_credentials(directory: Path, access: ApiAccess, pod: JsonObject, token: str) -> Path:
    """Write token, ca.crt, namespace and kubeconfig into `directory`; returns the kubeconfig."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(access.ca_file, directory / "ca.crt")
    (directory / "namespace").write_text(pod["metadata"]["namespace"])
    (directory / "token").write_text(token)
    user = f"system:serviceaccount:{service_account_name(pod)}"
    return write_kubeconfig(directory / "kubeconfig", access.server, directory / "ca.crt", user, token)
