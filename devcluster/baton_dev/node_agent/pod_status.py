"""A pod's status as the kubelet would write it, computed from its containers' runtime state."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_dev.kubeapi import JsonObject
from baton_dev.node_agent.container import ContainerRuntime
from baton_dev.node_agent.context import HOST_IP, now_rfc3339


def pod_phase(init: list[ContainerRuntime], containers: list[ContainerRuntime], init_failed: bool) -> str:
    if init_failed:
        return "Failed"
    if not all(c.final for c in init):
        return "Pending"
    if containers and all(c.final for c in containers):
        failed = any(c.state.get("terminated", {}).get("exitCode", 1) != 0 for c in containers)
        return "Failed" if failed else "Succeeded"
    if all(c.ever_started for c in containers):
        return "Running"
    return "Pending"


@dataclass
class PodStatusWriter:
    """Keeps each condition's last transition time across status writes."""

    ip: str
    start_time: str = field(default_factory=now_rfc3339)
    _transitions: dict[str, tuple[str, str]] = field(default_factory=dict)

    def _condition(self, kind: str, value: bool, reason: str = "") -> JsonObject:
        status = "True" if value else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, now_rfc3339())
        condition: JsonObject = {
            "type": kind,
            "status": status,
            "lastTransitionTime": self._transitions[kind][1],
        }
        if reason:
            condition["reason"] = reason
        return condition

    def status(
        self,
        pod: JsonObject,
        init: list[ContainerRuntime],
        containers: list[ContainerRuntime],
        init_failed: bool,
    ) -> JsonObject:
        phase = pod_phase(init, containers, init_failed)
        initialized = all(c.final for c in init) and not init_failed
        containers_ready = all(c.ready for c in containers)
        # PodScheduled comes from the scheduler and readiness-gate conditions from their owners.
        existing = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        gates_ok = all(existing.get(g, {}).get("status") == "True" for g in gates)
        done = phase in ("Succeeded", "Failed")
        not_ready = "PodCompleted" if done else "ContainersNotReady"
        ready = containers_ready and gates_ok
        conditions = [
            existing.get("PodScheduled") or self._condition("PodScheduled", True),
            self._condition("PodReadyToStartContainers", not done),
            self._condition("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
            self._condition("ContainersReady", containers_ready, "" if containers_ready else not_ready),
            self._condition("Ready", ready, "" if ready else not_ready),
        ]
        conditions += [existing[g] for g in gates if g in existing]
        status: JsonObject = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in containers],
        }
        if init:
            status["initContainerStatuses"] = [c.status() for c in init]
        return status
