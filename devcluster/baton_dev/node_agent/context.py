"""What every pod worker of the agent shares: the API client, paths, back-off settings and the
agent's event log (JSON lines with wall-clock times, read by tests and by people)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from baton_dev.kubeapi import ApiAccess, AsyncKubeApi, JsonObject
from baton_dev.processes import start_ticks
from baton_dev.spec import GPU_RESOURCE

HOST_IP = "127.0.0.1"
EVENTS_FILE = "events.jsonl"


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class AgentContext:
    api: AsyncKubeApi
    access: ApiAccess
    state_dir: Path
    backoff_initial_s: float
    backoff_max_s: float
    gpus: int = 0
    background: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def pods_dir(self) -> Path:
        return self.state_dir / "pods"

    @property
    def pids_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def venv_bin(self) -> str:
        """Console scripts of the agent's own Python environment (images are ignored)."""
        return str(Path(sys.executable).parent)

    def record(self, event: str, **fields: object) -> None:
        """Append one line to events.jsonl: {"time": epoch seconds, "event": ..., ...}."""
        line = json.dumps({"time": time.time(), "event": event, **fields})
        with open(self.state_dir / EVENTS_FILE, "a") as f:
            f.write(line + "\n")

    def track_pid(self, pid: int) -> None:
        ticks = start_ticks(pid)
        if ticks is not None:
            (self.pids_dir / f"{pid}.pid").write_text(str(ticks))

    def untrack_pid(self, pid: int) -> None:
        (self.pids_dir / f"{pid}.pid").unlink(missing_ok=True)

    def spawn_background(self, coro: object) -> None:
        assert asyncio.iscoroutine(coro)
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def kube_event(
        self,
        pod: JsonObject,
        node: str,
        reason: str,
        message: str,
        container: str = "",
        warning: bool = False,
    ) -> None:
        """Post a core/v1 Event about the pod (what `kubectl describe pod` shows); best effort."""
        meta = pod["metadata"]
        involved: JsonObject = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        }
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        stamp = now_rfc3339()
        body: JsonObject = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": "baton-node-agent", "host": node},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }

        async def post() -> None:
            try:
                await self.api.post(f"/api/v1/namespaces/{meta['namespace']}/events", body)
            except Exception:  # events are informational only
                pass

        self.spawn_background(post())


def node_resources(gpus: int) -> dict[str, str]:
    """Capacity (= allocatable) of every process node: generous, so that CPU/memory requests
    never decide scheduling on a small machine; GPUs as configured."""
    return {
        "cpu": "64",
        "memory": "256Gi",
        "pods": "110",
        "ephemeral-storage": "100Gi",
        GPU_RESOURCE: str(gpus),
    }


def base_environment(venv_bin: str) -> dict[str, str]:
    """Host variables a process needs to run at all; the pod's own env comes on top."""
    env = {"PATH": venv_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}
    for name in ("HOME", "LANG", "LC_ALL", "TMPDIR", "TZ"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env
