"""What a local cluster consists of, and where its state lives."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

GPU_RESOURCE = "amd.com/gpu"
NODE_TYPE_LABEL = "type"  # type=kwok | type=process; tests opt in with a nodeSelector on it
#: kwok nodes are tainted, so that only pods opting in (this toleration, and a nodeSelector on
#: NODE_TYPE_LABEL) land there, where nothing runs: anything else, e.g. the operator of a plain
#: `helm install`, goes to a process node, where it runs.
KWOK_TAINT: dict[str, str] = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
KWOK_TOLERATION: dict[str, str] = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
KWOK_POD_CIDR = "127.1.0.0/16"  # kwok nodes get 127.1.<n>.0/24
# Process node n gets 127.<k>.<n>.0/24, k claimed per running cluster (node_agent/pod_range.py).
SERVICE_CIDR = "198.19.0.0/24"
ADMIN_USER = "admin"
RESTRICTED_USER = "restricted"
RESTRICTED_GROUP = "baton-dev:restricted"


@dataclass(frozen=True)
class ClusterSpec:
    name: str = "dev"
    kwok_nodes: int = 2
    kwok_gpus: int = 8
    process_nodes: int = 1
    process_gpus: int = 8
    # Process-node restart back-off (the kubelet uses 10 s doubling to 300 s).
    backoff_initial_s: float = 10.0
    backoff_max_s: float = 300.0
    use_service_account_credentials: bool = True

    def __post_init__(self) -> None:
        if not self.name.replace("-", "").isalnum():
            raise ValueError(f"cluster name {self.name!r}: use letters, digits and '-'")
        for field in ("kwok_nodes", "kwok_gpus", "process_nodes", "process_gpus"):
            if not 0 <= getattr(self, field) <= 250:
                raise ValueError(f"{field}={getattr(self, field)}: must be between 0 and 250")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def kwok_node_name(index: int) -> str:
    return f"kwok-node-{index}"


def process_node_name(index: int) -> str:
    return f"process-node-{index}"


def clusters_home() -> Path:
    """$BATON_DEV_HOME, else ~/.cache/baton/clusters."""
    override = os.environ.get("BATON_DEV_HOME")
    return Path(override) if override else Path.home() / ".cache" / "baton" / "clusters"
