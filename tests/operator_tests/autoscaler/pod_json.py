"""Engine Pods as the API server returns them (JSON), for the autoscaler's pod tests."""

from __future__ import annotations

from typing import Any

GPU_MESSAGE = "0/3 nodes are available: 3 Insufficient amd.com/gpu."


def pod(
    name: str,
    role: str | None = "prefill",
    *,
    phase: str = "Running",
    ip: str | None = "127.0.0.21",
    ready: bool = True,
    deleting: bool = False,
    port: int | None = 8001,
    conditions: list[dict[str, Any]] | None = None,
    container_statuses: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    labels = {"baton.dev/deployment": "demo", "app.kubernetes.io/name": "baton"}
    if role is not None:
        labels["baton.dev/role"] = role
    metadata: dict[str, Any] = {"name": name, "namespace": "default", "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T02:00:00Z"
    ports = [{"name": "kv-transfer", "containerPort": 5600}]
    if port is not None:
        ports.append({"name": "http", "containerPort": port, "protocol": "TCP"})
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    status["conditions"] = (
        conditions
        if conditions is not None
        else [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
    )
    if container_statuses is not None:
        status["containerStatuses"] = container_statuses
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "engine", "image": "baton-engine", "ports": ports}]},
        "status": status,
    }
