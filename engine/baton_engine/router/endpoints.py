"""Engine endpoints the router can send to, and the registry that discovery keeps current.

Discovery sources (static lists, the Kubernetes Pod watch) call ``upsert``/``remove``; listeners
(the load scraper, the KV-event subscriber) get ``added``/``removed`` events. A restarted pod is a
new endpoint (new pod uid or IP), so its predecessor's state (load, prefix index) is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from baton_engine import contract

EventKind = Literal["added", "removed"]


@dataclass(frozen=True)
class Endpoint:
    """One engine pod (or one static URL) in one role."""

    role: str  # contract.ROLE_PREFILL | ROLE_DECODE | ROLE_AGGREGATED
    url: str  # HTTP base URL without a trailing slash, e.g. "http://10.0.0.5:8000"
    name: str = ""  # pod name; the URL for static endpoints
    uid: str = ""  # pod uid ("" for static endpoints)
    ports: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)
    #: The pod's KV-compatibility key (label contract.LABEL_KV_COMPAT; "" without one): a
    #: prefill pod is paired only with decode pods of the same key.
    kv_key: str = ""
    #: How the pod hashes prompt blocks (its annotations); None: the router's own settings.
    block_size: int | None = None
    prefix_hash: str | None = None
    prefix_hash_seed: str | None = None  # the vllm-* hashes' root seed (None: the router's own)

    def __post_init__(self) -> None:
        if self.role not in contract.ENGINE_ROLES:
            raise ValueError(f"endpoint role: {self.role!r} is not one of {', '.join(contract.ENGINE_ROLES)}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint url: {self.url!r} is not an http(s)://host[:port] URL")
        if not self.name:
            object.__setattr__(self, "name", self.url)

    @property
    def key(self) -> str:
        """Identity: changes when the pod is replaced or restarted on a new IP."""
        return f"{self.role}/{self.uid or '-'}/{self.url}"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def http_port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def port(self, name: str) -> int:
        """A named container port, or the contract's default for that name."""
        return self.ports.get(name, contract.DEFAULT_PORTS.get(name, 0))

    def aliases(self) -> frozenset[str]:
        """Names a prefix index might use for this pod (the KV-event topic carries a pod address)."""
        host = self.host
        return frozenset(
            {
                self.key,
                self.name,
                self.url,
                host,
                f"{host}:{self.http_port}",
                f"{host}:{self.port(contract.PORT_KV_EVENTS)}",
            }
            | ({self.uid} if self.uid else set())
        )


#: The fragment item of a static URL that sets the pod's KV-compatibility key.
STATIC_KV_KEY = "kv-key"


def static_endpoint(role: str, url: str, ports: Mapping[str, int] | None = None) -> Endpoint:
    """An endpoint from a command-line URL; a bare host:port gets http://. A fragment of named
    ports (``http://h:8000#kv-events=5601,kv-replay=5602``) overrides ``ports`` for this pod, for
    several pods on one host; ``kv-key=KEY`` in it sets the pod's KV-compatibility key."""
    url, _, fragment = url.strip().partition("#")
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    own = dict(ports or {})
    kv_key = ""
    for item in filter(None, fragment.split(",")):
        name, _, value = item.partition("=")
        if name.strip() == STATIC_KV_KEY:
            kv_key = value.strip()
            continue
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"endpoint {url}: port {item!r} is not NAME=PORT with a TCP port")
        own[name.strip()] = int(value)
    return Endpoint(role=role, url=url, ports=own, kv_key=kv_key)


Listener = Callable[[EventKind, Endpoint], None]


class EndpointRegistry:
    """The current endpoints by role. Single-threaded (the router's event loop)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Endpoint] = {}
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` for every later change, after replaying the current endpoints as added."""
        self._listeners.append(listener)
        for endpoint in list(self._by_key.values()):
            listener("added", endpoint)

    def upsert(self, endpoint: Endpoint) -> None:
        known = self._by_key.get(endpoint.key)
        if known == endpoint:
            return
        if known is not None:  # the same pod relabelled (another key): its state goes with it
            self.remove(endpoint.key)
        self._by_key[endpoint.key] = endpoint
        self._emit("added", endpoint)

    def remove(self, key: str) -> None:
        endpoint = self._by_key.pop(key, None)
        if endpoint is not None:
            self._emit("removed", endpoint)

    def replace_source(self, owned: Iterable[str], current: Iterable[Endpoint]) -> set[str]:
        """Make the endpoints whose keys are in ``owned`` equal to ``current``; return the new keys."""
        fresh = {e.key: e for e in current}
        for key in set(owned) - set(fresh):
            self.remove(key)
        for endpoint in fresh.values():
            self.upsert(endpoint)
        return set(fresh)

    def get(self, key: str) -> Endpoint | None:
        return self._by_key.get(key)

    def by_role(self, role: str, kv_key: str | None = None) -> list[Endpoint]:
        """The role's endpoints; only those of KV-compatibility key `kv_key` unless it is None."""
        return sorted(
            (e for e in self._by_key.values() if e.role == role and (kv_key is None or e.kv_key == kv_key)),
            key=lambda e: e.key,
        )

    def all(self) -> list[Endpoint]:
        return sorted(self._by_key.values(), key=lambda e: e.key)

    def _emit(self, kind: EventKind, endpoint: Endpoint) -> None:
        for listener in list(self._listeners):
            listener(kind, endpoint)
