"""A thin async Kubernetes client for the operator: server-side apply, create-only, status.

Plain REST over aiohttp (which Kopf already uses) with Kopf's own credential loaders, so the
operator needs no generated API client: any kind the builders render can be applied by path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from baton_operator import models

FIELD_MANAGER = "baton-operator"
#: Optional CRDs (PodMonitor) are looked up at most this often per operator.
CRD_CACHE_SECONDS = 60.0
#: Requests in flight at once, across every reconcile: each TLS connection holds buffers of a
#: few hundred kB and each queued write its encoded body, so a burst of hundreds of reconciles
#: waits here rather than in memory; more would not help an API server on a few cores anyway.
MAX_IN_FLIGHT = 32
JSON = dict[str, Any]
#: Told of every request sent, with its verb and the resource its path names (see `resource_of`);
#: the operator counts them in a metric.
RequestHook = Callable[[str, str], None]

#: (apiVersion, kind) -> plural of every kind the operator writes or reads.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "ReplicaSet"): "replicasets",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    (models.API_VERSION, models.KIND): models.PLURAL,
}


def _status_fields(text: str) -> tuple[str, str]:
    """(message, reason) of an error answer: a Kubernetes Status object, or any text."""
    try:
        answer = json.loads(text)
    except ValueError:
        return text, ""
    if not isinstance(answer, dict):
        return text, ""
    reason = answer.get("reason")
    return str(answer.get("message", text)), reason if isinstance(reason, str) else ""


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when no response came), `reason` the
    answer's Status reason (``Invalid``, ``Forbidden``, ``Conflict``; empty when it had none)."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.reason = reason


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{name}"


def path_of(manifest: Mapping[str, Any]) -> str:
    meta = manifest["metadata"]
    return object_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])


def resource_of(path: str) -> str:
    """The resource a request path names, for metrics: `deployments`, `inferencedeployments/status`."""
    parts = path.strip("/").split("?")[0].split("/")
    if "namespaces" in parts:
        rest = parts[parts.index("namespaces") + 2 :]
    else:
        rest = parts[3:] if parts[0] == "apis" else parts[2:]
    if not rest:
        return "namespaces"
    return f"{rest[0]}/{rest[2]}" if len(rest) > 2 else rest[0]


def login() -> kopf.ConnectionInfo:
    """In-cluster credentials inside a pod, otherwise the kubeconfig ($KUBECONFIG)."""
    settings = kopf.OperatorSettings()
    logger = logging.getLogger("baton_operator.kube")
    info = kopf.login_with_service_account(settings=settings, logger=logger) or kopf.login_with_kubeconfig(
        settings=settings, logger=logger
    )
    if info is None:
        raise KubeError(0, "no Kubernetes credentials: neither a service account nor a kubeconfig")
    return info


#: ConnectionInfo fields the TLS connection is built from: when a re-read changes one of them
#: the session is rebuilt; otherwise only the request headers (the token) change.
_TRANSPORT_FIELDS = (
    "server", "ca_path", "ca_data", "insecure", "certificate_path", "certificate_data",
    "private_key_path", "private_key_data",
)  # fmt: skip


class Kube:
    """One API server connection. `credentials` is called again after a 401 (rotated tokens),
    once however many concurrent requests got that 401."""

    def __init__(
        self,
        credentials: Callable[[], kopf.ConnectionInfo] = login,
        field_manager: str = FIELD_MANAGER,
        on_request: RequestHook | None = None,
    ) -> None:
        self.credentials = credentials
        self.field_manager = field_manager
        self.on_request = on_request
        self._session: aiohttp.ClientSession | None = None
        self._info: kopf.ConnectionInfo | None = None
        self._auth_headers: dict[str, str] = {}
        self._login_generation = 0  # bumped at each credentials re-read
        self._crds: dict[str, tuple[bool, float]] = {}  # name -> (exists, when checked)
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    def _login(self) -> None:
        info = self.credentials()
        if self._info is not None and any(
            getattr(info, f) != getattr(self._info, f) for f in _TRANSPORT_FIELDS
        ):
            self._discard_session()
        self._info = info
        self._auth_headers = dict(info.as_http_headers())
        self._login_generation += 1

    def _discard_session(self) -> None:
        if self._session is not None:
            # Requests still using it fail (and are retried by their callers); this happens only
            # when the server address or TLS material changed.
            session, self._session = self._session, None
            asyncio.get_running_loop().create_task(session.close())

    def _connect(self) -> aiohttp.ClientSession:
        if self._info is None:
            self._login()
        if self._session is None:
            assert self._info is not None
            connector = aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=MAX_IN_FLIGHT)
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=60),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._info = None

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        answer: bool = True,
    ) -> JSON:
        """One request; its JSON answer ({} when `answer` is False: not decoded)."""
        async with self._slots:
            return await self._send(method, path, body, query or [], content_type, answer)

    async def _send(
        self, method: str, path: str, body: Any, query: list[tuple[str, str]], content_type: str, answer: bool
    ) -> JSON:
        data = json.dumps(body) if body is not None else None
        for attempt in (1, 2):
            session = self._connect()
            generation = self._login_generation
            if self.on_request is not None:
                self.on_request(method, resource_of(path))
            headers = {**self._auth_headers, "Content-Type": content_type, "Accept": "application/json"}
            try:
                async with session.request(
                    method, path.lstrip("/"), params=query, data=data, headers=headers
                ) as resp:
                    if resp.status == 401 and attempt == 1:
                        await resp.read()
                        if generation == self._login_generation:
                            self._login()  # re-read the (possibly rotated) credentials once
                        continue
                    if resp.status >= 400:
                        message, reason = _status_fields(await resp.text())
                        raise KubeError(resp.status, message, reason)
                    if not answer:
                        await resp.read()
                        return {}
                    text = await resp.text()
                    result = json.loads(text) if text else {}
                    return result if isinstance(result, dict) else {}
            except aiohttp.ClientError as exc:
                raise KubeError(0, f"{method} {path}: {exc}") from exc
        raise KubeError(401, f"{method} {path}: unauthorized")

    async def apply(
        self,
        manifest: Mapping[str, Any],
        force: bool = True,
        field_manager: str | None = None,
        answer: bool = True,
    ) -> JSON:
        """Server-side apply under the operator's field manager (or `field_manager`); fields it
        owns are forced. The object as stored, or {} when `answer` is False (not decoded)."""
        manager = field_manager or self.field_manager
        query = [("fieldManager", manager), ("force", "true" if force else "false")]
        return await self._call(
            "PATCH", path_of(manifest), dict(manifest), query, "application/apply-patch+yaml", answer
        )

    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create; an existing object is left untouched and never read. True when created."""
        meta = manifest["metadata"]
        path = collection_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            await self._call(
                "POST", path, dict(manifest), [("fieldManager", self.field_manager)], answer=False
            )
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

    async def get_path(self, path: str) -> JSON | None:
        """GET any API path; None when it is not found."""
        try:
            return await self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[JSON]:
        """The objects of a kind in a namespace matching every label in `labels`."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        query = [("labelSelector", selector)] if selector else []
        result = await self._call("GET", collection_path(api_version, kind, namespace), None, query)
        items = result.get("items") or []
        return [i for i in items if isinstance(i, dict)]

    async def crd_exists(self, name: str) -> bool:
        """Whether a CRD is installed; answers are cached for CRD_CACHE_SECONDS."""
        cached = self._crds.get(name)
        now = time.monotonic()
        if cached is not None and now - cached[1] < CRD_CACHE_SECONDS:
            return cached[0]
        try:
            await self._call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            exists = True
        except KubeError as exc:
            if exc.status != 404:
                raise
            exists = False
        self._crds[name] = (exists, now)
        return exists

    def forget_crd(self, name: str) -> None:
        """Drop the cached answer about a CRD (the API has just contradicted it)."""
        self._crds.pop(name, None)

    async def patch_status(
        self, namespace: str, name: str, status: Mapping[str, Any], field_manager: str | None = None
    ) -> JSON:
        """Merge-patch the InferenceDeployment's status subresource (other status keys are kept),
        under the operator's field manager (or `field_manager`)."""
        path = object_path(models.API_VERSION, models.KIND, namespace, name) + "/status"
        query = [("fieldManager", field_manager or self.field_manager)]
        return await self._call(
            "PATCH", path, {"status": dict(status)}, query, "application/merge-patch+json"
        )

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> JSON:
        """JSON merge patch (RFC 7386) of one object under the operator's field manager; a
        `metadata.resourceVersion` in `patch` makes it conditional (409 if the object changed)."""
        query = [("fieldManager", self.field_manager)]
        path = object_path(api_version, kind, namespace, name)
        return await self._call("PATCH", path, dict(patch), query, "application/merge-patch+json")

    async def set_owner(self, manifest: Mapping[str, Any]) -> None:
        """Make `manifest`'s owner references the only ones of the existing object (a merge
        patch: the list is replaced), without reading it (the operator may not read Secrets)."""
        owners = {"metadata": {"ownerReferences": manifest["metadata"]["ownerReferences"]}}
        query = [("fieldManager", self.field_manager)]
        await self._call(
            "PATCH", path_of(manifest), owners, query, "application/merge-patch+json", answer=False
        )
