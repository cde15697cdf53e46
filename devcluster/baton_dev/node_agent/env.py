"""A container's environment as the kubelet would build it: envFrom, then env in order, with
fieldRef / resourceFieldRef / configMapKeyRef / secretKeyRef and $(VAR) expansion."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from baton_dev.kubeapi import ApiError, AsyncKubeApi, JsonObject

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(RuntimeError):
    """The container cannot start yet (CreateContainerConfigError): a missing key or object."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, unknown ones kept, $$ is a literal $."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def field_value(pod: JsonObject, path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod["metadata"]
    simple: dict[str, str] = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ConfigError(f"fieldRef {path!r} is not supported by the process node agent")


_SUFFIX = {
    "m": 1e-3,
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "2", "1Gi", "1e3") as a number."""
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(text).strip())
    if m is None or m.group(2) not in _SUFFIX:
        raise ConfigError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def resource_value(container: JsonObject, ref: JsonObject, allocatable: dict[str, str] | None = None) -> str:
    """resourceFieldRef as the kubelet resolves it: the limit (else the node's allocatable),
    or the request (else 0), divided by the divisor and rounded up."""
    kind, _, name = str(ref["resource"]).partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None:
        value = (allocatable or {}).get(name, "0") if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


Getter = Callable[[str, str], Awaitable[JsonObject | None]]


def object_getter(api: AsyncKubeApi, namespace: str) -> Getter:
    """Fetch configmaps/secrets once per container start; None when absent."""
    cache: dict[tuple[str, str], JsonObject | None] = {}

    async def get(kind: str, name: str) -> JsonObject | None:
        if (kind, name) not in cache:
            try:
                cache[(kind, name)] = await api.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
            except ApiError as e:
                if e.status != 404:
                    raise
                cache[(kind, name)] = None
        return cache[(kind, name)]

    return get


def _data(obj: JsonObject, kind: str) -> dict[str, str]:
    if kind == "secrets":
        return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    return dict(obj.get("data") or {})


async def _key_ref(get: Getter, kind: str, ref: JsonObject) -> str | None:
    obj = await get(kind, ref["name"])
    optional = bool(ref.get("optional", False))
    if obj is None:
        if optional:
            return None
        raise ConfigError(f"{kind[:-1]} {ref['name']!r} not found")
    data = _data(obj, kind)
    if ref["key"] not in data:
        if optional:
            return None
        raise ConfigError(f"key {ref['key']!r} not found in {kind[:-1]} {ref['name']!r}")
    return data[ref["key"]]


async def container_env(
    pod: JsonObject,
    container: JsonObject,
    base: dict[str, str],
    get: Getter,
    pod_ip: str,
    host_ip: str,
    allocatable: dict[str, str] | None = None,
) -> dict[str, str]:
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            ref: dict[str, Any] | None = source.get(key)
            if ref is None:
                continue
            obj = await get(kind, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"{kind[:-1]} {ref['name']!r} not found (envFrom)")
            env.update({prefix + k: v for k, v in _data(obj, kind).items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            value = resource_value(container, source["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in source:
            value = await _key_ref(get, "configmaps", source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = await _key_ref(get, "secrets", source["secretKeyRef"])
        else:
            raise ConfigError(f"env {name!r}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env
