"""In-memory copies of watched objects, so that a status refresh needs no GETs.

The operator sees every child Deployment and every InferenceDeployment through Kopf's watches,
and every object it writes in the write's answer. Both feed one cache per kind, which keeps only
the fields a status refresh reads (whole objects of hundreds of resources would cost the
operator tens of MB) and never lets an older copy replace a newer one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from baton_engine.contract import LABEL_DEPLOYMENT, LABEL_ROLE

Key = tuple[str, str]  # (namespace, name)
View = Callable[[Mapping[str, Any]], dict[str, Any]]

#: What a status refresh reads of an InferenceDeployment's spec: enough for `parse_spec` to
#: give the roles, the router endpoint, the pools' KV-compatibility keys and whether they may be
#: scaled to zero (every other spec field has a default).
OWNER_SPEC_FIELDS = (
    "spec.model",
    "spec.mode",
    "spec.router",
    "spec.engine",
    "spec.prefill",
    "spec.decode",
    "spec.autoscaling",
)
#: The status fields the operator writes (and compares before writing); not the autoscaler's.
OWNER_STATUS_FIELDS = tuple(
    f"status.{key}"
    for key in ("observedGeneration", "conditions", "endpoint", "prefill", "decode", "pool", "router")
)
#: What `resource_status.compute_status` reads of a Deployment.
DEPLOYMENT_STATUS_FIELDS = ("observedGeneration", "replicas", "readyReplicas", "updatedReplicas")
_CONDITION_FIELDS = ("type", "status", "reason", "message")  # not their timestamps
_META_FIELDS = ("name", "namespace", "uid", "generation", "resourceVersion")


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as an integer, None if it has none or it is not numeric.

    Kubernetes calls resourceVersion opaque, but the API server in use (etcd-backed) hands out
    its increasing revision: comparing them only keeps a late watch event from overwriting the
    newer copy a write just returned; a non-numeric one simply always replaces."""
    value = obj.get("metadata", {}).get("resourceVersion")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def slim(obj: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `obj` with its identifying metadata and the dotted `fields` (absent ones left out)."""
    meta = obj.get("metadata", {})
    out: dict[str, Any] = {"metadata": {k: meta[k] for k in _META_FIELDS if k in meta}}
    for dotted in fields:
        source: Any = obj
        parts = dotted.split(".")
        for part in parts:
            source = source.get(part) if isinstance(source, Mapping) else None
            if source is None:
                break
        if source is None:
            continue
        target = out
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = _copy(source)
    return out


def owner_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An InferenceDeployment as a status refresh needs it."""
    return slim(obj, OWNER_SPEC_FIELDS + OWNER_STATUS_FIELDS)


def replicas_managers(obj: Mapping[str, Any]) -> list[str]:
    """The field managers that own a Deployment's `spec.replicas` (sorted)."""
    owners = set()
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        fields = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if isinstance(fields, Mapping) and "f:replicas" in fields:
            owners.add(str(entry.get("manager", "")))
    return sorted(owners)


def deployment_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A Deployment as `resource_status.compute_status` reads it: replicas, counts, and its conditions
    without timestamps (a condition re-stamped with nothing else new is no change); and who owns
    its replicas (`replicasManagers`), for the reconcile's ownership handover."""
    view = slim(obj, ("spec.replicas",))
    status = obj.get("status") or {}
    kept: dict[str, Any] = {k: status[k] for k in DEPLOYMENT_STATUS_FIELDS if k in status}
    if status.get("conditions"):
        kept["conditions"] = [{k: c[k] for k in _CONDITION_FIELDS if k in c} for c in status["conditions"]]
    view["status"] = kept
    view["replicasManagers"] = replicas_managers(obj)
    return view


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "metadata"}


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value


#: Deleted objects remembered per cache (their names' last deleted UIDs), so that a late copy of
#: one (a handler still holding its body) is not taken for a live object. Oldest forgotten first.
MAX_TOMBSTONES = 4096


class ObjectCache:
    """Views (`view(obj)`: small copies) of one kind's objects by (namespace, name); the newest
    resourceVersion wins, across UIDs too (a re-created object has a higher one than its
    predecessor's last), and a UID once deleted is never taken back."""

    def __init__(self, view: View) -> None:
        self.view = view
        self._objects: dict[Key, dict[str, Any]] = {}
        self._deleted: dict[Key, str] = {}  # key -> UID of the object last deleted there

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((namespace, name))

    def uid(self, namespace: str, name: str) -> str | None:
        """UID of the object held under that name (the live one, as far as this cache knows)."""
        held = self._objects.get((namespace, name))
        return None if held is None else held["metadata"].get("uid")

    def observe(self, obj: Mapping[str, Any]) -> bool:
        """Store `obj` unless the cache holds a newer version of it (or of a newer object of its
        name), or it was deleted. True when the cached fields (all but metadata) changed: a first
        sight, a new object of that name, or new content."""
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if meta.get("uid") is not None and self._deleted.get(key) == meta.get("uid"):
            return False
        held = self._objects.get(key)
        old, new = (None if held is None else resource_version(held)), resource_version(obj)
        if held is not None and old is not None and new is not None and new < old:
            return False
        fresh = self.view(obj)
        self._objects[key] = fresh
        if held is None or held["metadata"].get("uid") != meta.get("uid"):
            return True
        return _content(held) != _content(fresh)

    def forget(self, obj: Mapping[str, Any]) -> None:
        """Drop the object (it was deleted) unless a newer one of that name (another uid) is
        held; either way its UID is never taken back."""
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        uid = meta.get("uid")
        held = self._objects.get(key)
        if held is not None and held["metadata"].get("uid") == uid:
            del self._objects[key]
        if uid is not None:
            self._deleted.pop(key, None)
            self._deleted[key] = uid
            while len(self._deleted) > MAX_TOMBSTONES:
                del self._deleted[next(iter(self._deleted))]


def pod_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A pod as `pod_problems` reads it: its labels, deletion, phase, conditions and container
    states (not their timestamps, but a running container's start)."""
    view = slim(obj, ("metadata.labels", "metadata.deletionTimestamp", "status.phase"))
    status = obj.get("status") or {}
    if status.get("conditions"):
        view.setdefault("status", {})["conditions"] = [
            {k: c[k] for k in _CONDITION_FIELDS if k in c} for c in status["conditions"]
        ]
    for key in ("initContainerStatuses", "containerStatuses"):
        if status.get(key):
            view.setdefault("status", {})[key] = [_container_view(c) for c in status[key]]
    return view


def _container_view(status: Mapping[str, Any]) -> dict[str, Any]:
    state = status.get("state") or {}
    kept: dict[str, Any] = {k: status[k] for k in ("name", "ready", "started", "restartCount") if k in status}
    if "waiting" in state:
        kept["state"] = {"waiting": {k: v for k, v in state["waiting"].items() if k in ("reason", "message")}}
    elif "running" in state:
        kept["state"] = {"running": {"startedAt": state["running"].get("startedAt")}}
    elif "terminated" in state:
        kept["state"] = {"terminated": {k: state["terminated"].get(k) for k in ("exitCode", "reason")}}
    last = (status.get("lastState") or {}).get("terminated")
    if last:
        kept["lastState"] = {"terminated": {k: last.get(k) for k in ("exitCode", "reason")}}
    return kept


class PodIndex:
    """The operator's pods (engine pools and routers) from the pod watch, by the resource and
    pool they belong to (their `baton.dev/deployment` and `baton.dev/role` labels)."""

    def __init__(self) -> None:
        self.cache = ObjectCache(pod_view)
        self._owned: dict[Key, set[str]] = {}  # (namespace, resource name) -> pod names

    def __len__(self) -> int:
        return len(self.cache)

    @staticmethod
    def owner(obj: Mapping[str, Any]) -> Key | None:
        meta = obj.get("metadata", {})
        name = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
        return None if not name else (str(meta.get("namespace", "")), str(name))

    def observe(self, obj: Mapping[str, Any]) -> bool:
        key = self.owner(obj)
        if key is None:
            return False
        self._owned.setdefault(key, set()).add(str(obj["metadata"]["name"]))
        return self.cache.observe(obj)

    def forget(self, obj: Mapping[str, Any]) -> None:
        self.cache.forget(obj)
        key = self.owner(obj)
        if key is not None and self.cache.get(key[0], obj["metadata"]["name"]) is None:
            names = self._owned.get(key, set())
            names.discard(str(obj["metadata"]["name"]))
            if not names:
                self._owned.pop(key, None)

    def of(self, namespace: str, name: str) -> dict[str, list[dict[str, Any]]]:
        """Pool (role) -> the views of its pods, for one resource."""
        pools: dict[str, list[dict[str, Any]]] = {}
        for pod_name in sorted(self._owned.get((namespace, name), ())):
            view = self.cache.get(namespace, pod_name)
            if view is not None:
                role = str((view["metadata"].get("labels") or {}).get(LABEL_ROLE, ""))
                pools.setdefault(role, []).append(view)
        return pools
