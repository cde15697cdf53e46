"""Hugging Face safetensors directories: config.json, *.safetensors shards, tokenizer files.

Tensors are read lazily from the memory-mapped shards (`SafetensorsSource`): a tensor-parallel
rank reads only its slice of each one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from baton_engine.model.config import ModelConfig
from baton_engine.model.loader.hf_config import model_config_from_hf


def read_raw_config(directory: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return raw


def read_config(directory: Path, name: str = "") -> ModelConfig:
    return model_config_from_hf(read_raw_config(directory), name)


class SafetensorsSource:
    """One tensor of an open shard; `read` slices it in the file (safetensors' ``get_slice``)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(int(d) for d in self._slice.get_shape())

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        if not index:
            tensor: torch.Tensor = self._handle.get_tensor(self._name)
            return tensor
        sliced: torch.Tensor = self._slice[index]
        return sliced


def shard_files(directory: Path) -> list[Path]:
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} holds no *.safetensors file")
    return shards


@contextmanager
def open_weights(directory: Path) -> Iterator[dict[str, SafetensorsSource]]:
    """Every tensor of every shard by checkpoint name, readable while the context is open."""
    with ExitStack() as stack:
        sources: dict[str, SafetensorsSource] = {}
        for shard in shard_files(directory):
            handle = stack.enter_context(safe_open(str(shard), framework="pt", device="cpu"))
            for name in handle.keys():
                sources[name] = SafetensorsSource(handle, name)
        yield sources
