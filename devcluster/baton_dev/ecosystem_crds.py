"""Third-party CRDs the interop tests (and anyone trying Baton beside them) install on the local
control plane, read from their projects' releases as Go modules: `go mod download` through the Go
module proxy into the shared module cache (~/.cache/baton/gomod, the one devcluster/scripts/build.sh
uses), so nothing is copied into this repository and a cached module needs no network."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ModuleCrd:
    """One CRD file of a released Go module."""

    module: str
    version: str
    path: str  # inside the module
    name: str  # metadata.name of the CRD

    @property
    def reference(self) -> str:
        return f"{self.module}@{self.version}/{self.path}"


#: The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1).
GIE_INFERENCE_POOL = ModuleCrd(
    "sigs.k8s.io/gateway-api-inference-extension",
    "v1.6.0",
    "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
    "inferencepools.inference.networking.k8s.io",
)
#: KEDA's ScaledObject (keda.sh/v1alpha1).
KEDA_SCALED_OBJECT = ModuleCrd(
    "github.com/kedacore/keda/v2",
    "v2.21.0",
    "config/crd/bases/keda.sh_scaledobjects.yaml",
    "scaledobjects.keda.sh",
)


class ModuleUnavailable(RuntimeError):
    """The Go module could not be downloaded (no Go, or no module proxy and not cached)."""


def go_env() -> dict[str, str]:
    """The environment build.sh downloads Go modules with (same cache, no toolchain switch)."""
    cache = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))
    return {
        **os.environ,
        "GOMODCACHE": os.environ.get("GOMODCACHE_OVERRIDE", str(cache / "gomod")),
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-mod=mod",
    }


def module_dir(module: str, version: str, timeout_s: float = 600.0) -> Path:
    """The extracted module in the module cache, downloaded first if it is not there."""
    try:
        done = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"],
            capture_output=True,
            text=True,
            env=go_env(),
            timeout=timeout_s,
            cwd=Path.home(),  # outside any Go module: download only, never edit a go.mod
        )
    except FileNotFoundError as exc:
        raise ModuleUnavailable("Go is not installed (it downloads the module)") from exc
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        answer = {}
    if done.returncode != 0 or "Dir" not in answer:
        error = answer.get("Error") or done.stderr.strip() or f"exit status {done.returncode}"
        raise ModuleUnavailable(f"go mod download {module}@{version}: {error}")
    return Path(answer["Dir"])


def load(crd: ModuleCrd) -> dict[str, Any]:
    """The CustomResourceDefinition as the release ships it."""
    text = (module_dir(crd.module, crd.version) / crd.path).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    (doc,) = docs
    if doc.get("kind") != "CustomResourceDefinition" or doc["metadata"]["name"] != crd.name:
        raise ValueError(f"{crd.reference} is not the CRD {crd.name}")
    result: dict[str, Any] = doc
    return result
