"""Where the built control-plane binaries live (see devcluster/scripts/build.sh)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build.sh"
REQUIRED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
KWOK_STAGE_FILES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)


class BinariesMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Binaries:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def kubectl(self) -> Path:
        return self.directory / "kubectl"

    @property
    def helm(self) -> Path:
        return self.directory / "helm"

    @property
    def kwok_stages(self) -> Path:
        return self.directory / "kwok-stages"


def binaries_dir() -> Path:
    """$BATON_K8S_BIN, else the version-keyed directory that build.sh builds into."""
    override = os.environ.get("BATON_K8S_BIN")
    if override:
        return Path(override)
    if not BUILD_SCRIPT.exists():
        raise BinariesMissing(f"set BATON_K8S_BIN: {BUILD_SCRIPT} is not there to locate the binaries")
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def find_binaries() -> Binaries:
    """The built binaries, or BinariesMissing naming what is absent and how to build it."""
    directory = binaries_dir()
    missing = [name for name in REQUIRED if not os.access(directory / name, os.X_OK)]
    missing += [f"kwok-stages/{f}" for f in KWOK_STAGE_FILES if not (directory / "kwok-stages" / f).is_file()]
    if missing:
        raise BinariesMissing(
            f"missing in {directory}: {', '.join(missing)}; build them with `make cluster-build` "
            f"(bash {BUILD_SCRIPT})"
        )
    return Binaries(directory)
