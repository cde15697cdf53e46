"""Checkpoint tensors (Hugging Face names) -> this decoder's parameters, shard by shard.

Q/K/V projections load into one `qkv_proj` and gate/up into one `gate_up_proj` (each checkpoint
tensor as one part of the merged layer), so each layer runs three matrix products fewer per
step. Every parallel layer reads only its rank's shard of the tensor (`WeightSource.read`).
A module whose checkpoint tensors do not map one-to-one onto its parameters (the MoE block's
per-expert projections, stacked into two weights) loads them itself (`CheckpointModule`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

from torch import nn

from baton_engine.model.linear import ParallelLinear, VocabParallelEmbedding
from baton_engine.model.weight_source import WeightSource


@runtime_checkable
class CheckpointModule(Protocol):
    """A module that loads its own (and its submodules') checkpoint tensors."""

    def checkpoint_names(self) -> dict[str, Hashable]:
        """Every checkpoint name the module may load -> the key it loads it by."""
        ...

    def load_checkpoint_tensor(self, key: Hashable, source: WeightSource, name: str) -> None:
        """Copy this rank's shard of checkpoint tensor `name` (`key` its key)."""
        ...

    def missing_checkpoint_names(self, loaded: set[Hashable]) -> list[str]:
        """The names the module still needs after the keys `loaded` (alternatives: any one)."""
        ...

    def process_weights_after_loading(self) -> None:
        """Finish the loaded weights (e.g. quantize them)."""
        ...


@dataclass(frozen=True)
class _Target:
    module: nn.Module
    param: str
    part: int | None
    required: bool = True
    key: Hashable = None
    """A `CheckpointModule`'s key for the tensor (its own loader decides what is required)."""


def _targets(model: nn.Module) -> dict[str, _Target]:
    """Checkpoint name -> where it loads, for every parameter the checkpoint must or may fill."""
    targets: dict[str, _Target] = {}
    self_loading: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{owner}.") for owner in self_loading):
            continue  # loaded by the CheckpointModule above it
        if isinstance(module, CheckpointModule):
            self_loading.append(name)
            for full, key in module.checkpoint_names().items():
                targets[full] = _Target(cast(nn.Module, module), "", None, required=False, key=key)
        elif isinstance(module, ParallelLinear):
            parent = name.rpartition(".")[0]
            for param, sharding in module.shardings.items():
                if module.part_names:
                    for part, part_name in enumerate(module.part_names):
                        full = f"{parent}.{part_name}.{param}" if parent else f"{part_name}.{param}"
                        targets[full] = _Target(module, param, part, sharding.required)
                else:
                    targets[f"{name}.{param}"] = _Target(module, param, None, sharding.required)
        elif isinstance(module, VocabParallelEmbedding):
            targets[f"{name}.weight"] = _Target(module, "weight", None)
        else:
            for param, _ in module.named_parameters(recurse=False):
                targets[f"{name}.{param}"] = _Target(module, param, None)
    return targets


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, WeightSource]]) -> None:
    """Load `weights` (checkpoint names, e.g. ``model.layers.0.self_attn.q_proj.weight``) into
    `model`, then let every linear layer's method finish its weights. Tensors the model does not
    use are skipped; a missing one raises ValueError naming it."""
    targets = _targets(model)
    loaded: set[str] = set()
    self_loaded: dict[CheckpointModule, set[Hashable]] = {
        module: set() for module in model.modules() if isinstance(module, CheckpointModule)
    }
    for name, source in weights:
        target = targets.get(name)
        if target is None:
            continue
        module = target.module
        if isinstance(module, CheckpointModule):
            module.load_checkpoint_tensor(target.key, source, name)
            self_loaded[module].add(target.key)
        elif isinstance(module, ParallelLinear | VocabParallelEmbedding):
            module.load_weight(target.param, source, target.part)
        else:
            param = getattr(module, target.param)
            if tuple(source.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(source.shape)}, the model's {tuple(param.shape)}"
                )
            param.data.copy_(source.read())
        loaded.add(name)
    missing = sorted(name for name, target in targets.items() if target.required and name not in loaded)
    for owner, keys in self_loaded.items():
        missing += owner.missing_checkpoint_names(keys)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
    for module in model.modules():
        if isinstance(module, ParallelLinear):
            module.process_weights_after_loading()
    for self_loading_module in self_loaded:
        self_loading_module.process_weights_after_loading()
