"""A checkpoint tensor that is read only as far as a rank needs it.

Layers load their parameters from `WeightSource`s: a tensor already in memory (`TensorSource`),
a safetensors slice read from the memory-mapped file, or a GGUF tensor dequantized row by row
(see the loaders). A rank asks for its shard only (`read` with one slice per leading dimension),
so a tensor-parallel rank never materialises the other ranks' weights.
"""

from __future__ import annotations

from typing import Protocol

import torch

Index = tuple[slice, ...]
"""One slice per leading dimension (fewer slices than dimensions: the rest are whole); every
slice has a step of 1 and explicit bounds."""


class WeightSource(Protocol):
    @property
    def shape(self) -> tuple[int, ...]:
        """The full checkpoint tensor's shape (Hugging Face layout: ``[out, in]`` for a linear)."""
        ...

    def read(self, index: Index = ()) -> torch.Tensor:
        """The selected region as a CPU tensor (a copy or a view the caller only reads)."""
        ...


class TensorSource:
    """A tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, index: Index = ()) -> torch.Tensor:
        return self.tensor[index] if index else self.tensor


def as_source(weight: torch.Tensor | WeightSource) -> WeightSource:
    return TensorSource(weight) if isinstance(weight, torch.Tensor) else weight


def full_index(shape: tuple[int, ...], dims: dict[int, slice]) -> Index:
    """A read index over the leading dimensions up to the last one `dims` narrows."""
    if not dims:
        return ()
    return tuple(dims.get(d, slice(0, shape[d])) for d in range(max(dims) + 1))
