"""Where the engine pods are: static URL lists, or a watch on Kubernetes Pods.

A pod counts when its Ready condition is True, it has no deletionTimestamp and it has a
``status.podIP``. Its ports come from named container ports (contract.PORT_*), falling back to
the contract's defaults. A restarted pod (new uid or IP) is a new endpoint, so the registry emits
``removed`` for the old one and ``added`` for the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from baton_engine import contract
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, static_endpoint
from baton_engine.router.prefix import PREFIX_HASHES

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; we list again and re-watch
_RETRY_S = (0.5, 1.0, 2.0, 5.0)


# --------------------------------------------------------------------------- static lists


def static_endpoints(
    role_urls: Mapping[str, Sequence[str]], ports: Mapping[str, int] | None = None
) -> list[Endpoint]:
    """Endpoints from command-line URLs by role (all with the same named ``ports``); duplicate URLs
    within a role are an error."""
    out: list[Endpoint] = []
    for role, urls in role_urls.items():
        seen: set[str] = set()
        for url in urls:
            endpoint = static_endpoint(role, url, ports)
            if endpoint.url in seen:
                raise ValueError(f"{role} endpoints: {endpoint.url} given twice")
            seen.add(endpoint.url)
            out.append(endpoint)
    return out


# --------------------------------------------------------------------------- pods -> endpoints


def _is_ready(status: Mapping[str, Any]) -> bool:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def named_ports(pod: Mapping[str, Any]) -> dict[str, int]:
    """Named container ports of every container (the first container naming a port wins)."""
    ports: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            name, number = port.get("name"), port.get("containerPort")
            if isinstance(name, str) and isinstance(number, int) and name not in ports:
                ports[name] = number
    return ports


def endpoint_from_pod(pod: Mapping[str, Any], role: str) -> Endpoint | None:
    """The endpoint of a pod as the API returns it (camelCase JSON), or None if it must not get traffic."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    if not ip or not _is_ready(status):
        return None
    ports = named_ports(pod)
    host = f"[{ip}]" if ":" in ip else ip
    http_port = ports.get(contract.PORT_HTTP, contract.DEFAULT_HTTP_PORT)
    labels = metadata.get("labels") or {}
    block_size, prefix_hash, seed = pod_hashing(metadata)
    return Endpoint(
        role=role,
        url=f"http://{host}:{http_port}",
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        ports=ports,
        kv_key=str(labels.get(contract.LABEL_KV_COMPAT, "")),
        block_size=block_size,
        prefix_hash=prefix_hash,
        prefix_hash_seed=seed,
    )


def pod_hashing(metadata: Mapping[str, Any]) -> tuple[int | None, str | None, str | None]:
    """The block size, prefix hash and hash seed a pod's annotations declare (None where absent
    or not usable: the router's own settings apply then)."""
    annotations = metadata.get("annotations") or {}
    size = str(annotations.get(contract.ANNOTATION_BLOCK_SIZE, ""))
    block_size = int(size) if size.isdigit() and int(size) > 0 else None
    prefix_hash = annotations.get(contract.ANNOTATION_PREFIX_HASH)
    if prefix_hash is not None and prefix_hash not in PREFIX_HASHES:
        name, annotation = metadata.get("name"), contract.ANNOTATION_PREFIX_HASH
        log.warning("pod %s: unknown %s %r ignored", name, annotation, prefix_hash)
        prefix_hash = None
    seed = annotations.get(contract.ANNOTATION_PREFIX_HASH_SEED)
    return block_size, prefix_hash, seed if isinstance(seed, str) and seed else None


def selector_string(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def default_namespace() -> str:
    with contextlib.suppress(OSError):
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return os.environ.get(contract.ENV_POD_NAMESPACE, "default")


class RolePods:
    """One role's pods as last listed or watched (API JSON by uid)."""

    def __init__(self, role: str, listed: Sequence[Mapping[str, Any]] = ()) -> None:
        self.role = role
        self._pods: dict[str, Mapping[str, Any]] = {}
        for pod in listed:
            self.apply("ADDED", pod)

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> bool:
        """Apply one watch event; False for events that change nothing (bookmarks)."""
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return False
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        if event_type == "DELETED":
            self._pods.pop(uid, None)
        else:
            self._pods[uid] = pod
        return True

    def endpoints(self) -> list[Endpoint]:
        found = (endpoint_from_pod(p, self.role) for p in self._pods.values())
        return [e for e in found if e is not None]


# --------------------------------------------------------------------------- Kubernetes watch


class KubernetesDiscovery:
    """Watches the Pods of each role's label selector in one namespace and keeps a registry current.

    Uses the in-cluster configuration when running in a pod, else KUBECONFIG (or ~/.kube/config).
    """

    def __init__(self, namespace: str, selectors: Mapping[str, str]) -> None:
        unknown = sorted(set(selectors) - set(contract.ENGINE_ROLES))
        if unknown:
            raise ValueError(f"kubernetes discovery: unknown role {unknown[0]!r}")
        if not namespace:
            raise ValueError("kubernetes discovery: namespace is empty")
        self.namespace = namespace
        self.selectors = dict(selectors)

    async def __call__(self, registry: EndpointRegistry) -> None:
        from kubernetes_asyncio import client, config  # imported lazily: static mode never needs it

        # An explicit $KUBECONFIG wins over the in-cluster service account (as for kubectl); the
        # local control plane's process nodes hand pods their token that way.
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            # kubernetes_asyncio reads $KUBECONFIG once, at import: pass it as it is now.
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        async with client.ApiClient() as api:
            core = client.CoreV1Api(api)
            await asyncio.gather(*(self._watch_role(core, registry, r, s) for r, s in self.selectors.items()))

    async def _watch_role(self, core: Any, registry: EndpointRegistry, role: str, selector: str) -> None:
        from kubernetes_asyncio import watch

        owned: set[str] = set()
        failures = 0
        try:
            while True:
                try:
                    response = await core.list_namespaced_pod(
                        self.namespace, label_selector=selector, _preload_content=False
                    )
                    listing = json.loads(await response.read())
                    pods = RolePods(role, listing.get("items") or [])
                    owned = registry.replace_source(owned, pods.endpoints())
                    version = (listing.get("metadata") or {}).get("resourceVersion")
                    async with watch.Watch().stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=selector,
                        resource_version=version,
                        timeout_seconds=_WATCH_TIMEOUT_S,
                        allow_watch_bookmarks=True,
                    ) as stream:
                        failures = 0
                        async for event in stream:
                            if pods.apply(event["type"], event["raw_object"]):
                                owned = registry.replace_source(owned, pods.endpoints())
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # 410 Gone, API server restarts, network: list again
                    delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
                    failures += 1
                    log.warning(
                        "pod watch (%s, %s) failed: %r; listing again in %.1fs", role, selector, exc, delay
                    )
                    await asyncio.sleep(delay)
        finally:
            for key in owned:
                registry.remove(key)
