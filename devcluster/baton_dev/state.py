"""The state file of a running cluster (state.json in its directory): ports, paths and the pids of
every process the harness started, so that `down` and `status` work from another process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton_dev.processes import ProcessRecord

STATE_FILE = "state.json"


@dataclass
class ClusterState:
    name: str
    directory: Path
    bin_dir: Path
    server: str
    ports: dict[str, int]
    spec: dict[str, Any]
    processes: list[ProcessRecord] = field(default_factory=list)
    ready_s: float | None = None

    @property
    def admin_kubeconfig(self) -> Path:
        return self.directory / "admin.kubeconfig"

    @property
    def restricted_kubeconfig(self) -> Path:
        return self.directory / "restricted.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.directory / "pki" / "ca.crt"

    @property
    def logs_dir(self) -> Path:
        return self.directory / "logs"

    @property
    def agent_dir(self) -> Path:
        """The node agent's own files: pod logs, pod kubeconfigs, live pid files, events."""
        return self.directory / "agent"

    def process(self, name: str) -> ProcessRecord | None:
        return next((p for p in self.processes if p.name == name), None)

    def save(self) -> None:
        data = {
            "name": self.name,
            "directory": str(self.directory),
            "bin_dir": str(self.bin_dir),
            "server": self.server,
            "ports": self.ports,
            "spec": self.spec,
            "processes": [p.to_json() for p in self.processes],
            "ready_s": self.ready_s,
        }
        tmp = self.directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.directory / STATE_FILE)

    @staticmethod
    def load(directory: Path) -> ClusterState:
        path = directory / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(f"no cluster state in {directory} (is the cluster up?)")
        data = json.loads(path.read_text())
        return ClusterState(
            name=data["name"],
            directory=Path(data["directory"]),
            bin_dir=Path(data["bin_dir"]),
            server=data["server"],
            ports={k: int(v) for k, v in data["ports"].items()},
            spec=data["spec"],
            processes=[ProcessRecord.from_json(p) for p in data["processes"]],
            ready_s=data.get("ready_s"),
        )
