"""A thin async Kubernetes client for the operator: server-side apply, create-only, status.

Built on kubernetes_asyncio's ApiClient (auth, TLS, in-cluster config) with plain REST paths, so
that any kind the builders render can be applied without a typed API class per kind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client, config

from baton_operator import models

FIELD_MANAGER = "baton-operator"
JSON = dict[str, Any]

#: (apiVersion, kind) -> plural of every kind the operator writes or reads.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    (models.API_VERSION, models.KIND): models.PLURAL,
}


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when no response came)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{name}"


def path_of(manifest: Mapping[str, Any]) -> str:
    meta = manifest["metadata"]
    return object_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])


async def new_api_client() -> client.ApiClient:
    """In-cluster credentials inside a pod, otherwise the kubeconfig ($KUBECONFIG)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    else:
        await config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient, field_manager: str = FIELD_MANAGER) -> None:
        self.api = api
        self.field_manager = field_manager

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        try:
            result = await self.api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                response_types_map={200: "object", 201: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        except client.ApiException as exc:
            raise KubeError(exc.status or 0, str(exc.body or exc.reason)) from exc
        return result if isinstance(result, dict) else {}

    async def apply(self, manifest: Mapping[str, Any], force: bool = True) -> JSON:
        """Server-side apply under the operator's field manager (fields it owns are forced)."""
        query = [("fieldManager", self.field_manager), ("force", "true" if force else "false")]
        return await self._call(
            "PATCH", path_of(manifest), dict(manifest), query, "application/apply-patch+yaml"
        )

    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create; an existing object is left untouched and never read. True when created."""
        meta = manifest["metadata"]
        path = collection_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            await self._call("POST", path, dict(manifest), [("fieldManager", self.field_manager)])
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete_if_present(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            await self._call("DELETE", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> JSON | None:
        try:
            return await self._call("GET", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def crd_exists(self, name: str) -> bool:
        try:
            await self._call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> JSON:
        """Merge-patch the InferenceDeployment's status subresource (other status keys are kept)."""
        path = object_path(models.API_VERSION, models.KIND, namespace, name) + "/status"
        return await self._call("PATCH", path, {"status": dict(status)}, None, "application/merge-patch+json")
