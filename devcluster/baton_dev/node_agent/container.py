"""Runtime state of one container of a pod on a process node, and its ContainerStatus."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from baton_dev.kubeapi import JsonObject


@dataclass
class ContainerRuntime:
    spec: JsonObject
    proc: asyncio.subprocess.Process | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    ever_started: bool = False
    final: bool = False  # exited and will not be restarted (restartPolicy)
    state: JsonObject = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: JsonObject = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def status(self) -> JsonObject:
        status: JsonObject = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.proc is not None:
            status["containerID"] = f"baton-process://{self.proc.pid}"
        return status
