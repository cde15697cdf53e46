"""Tensor parallelism as the model's layers see it: this rank's place in its group, how the
model's dimensions split across ranks, and the two collectives Megatron-style layers need.

Sharding (the layout every rank, the KV cache and KV transfer agree on):

* attention heads: rank ``r`` of ``N`` holds query heads ``[r * H / N, (r + 1) * H / N)``;
* KV heads: equal contiguous shares when ``N <= K`` (``N`` must divide ``K``), otherwise one head
  per rank, head ``r * K // N``, replicated on ``N / K`` consecutive ranks (``K`` must divide
  ``N``); either way a rank's query heads attend exactly to its KV heads;
* MLP intermediate features: equal contiguous shares;
* vocabulary: shares of ``ceil(V / N)`` rows, the last padded (padding rows never win: logits
  are gathered and cut back to ``V``).

`TensorParallel` is frozen and cheap to pass around; a model built without one runs on one
rank exactly as before (no collective is ever called).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from baton_engine.model.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """A contiguous run ``[start, start + length)`` of one dimension."""

    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


class TensorParallelShapeError(ValueError):
    """The tensor-parallel size cannot split this model (named dimension not divisible)."""


def even_shard(total: int, size: int, rank: int, what: str) -> Shard:
    """Rank `rank`'s equal share of `total` over `size` ranks; raises naming `what` if uneven."""
    if total % size:
        raise TensorParallelShapeError(
            f"--tensor-parallel-size {size} does not divide the model's {total} {what}"
        )
    share = total // size
    return Shard(rank * share, share)


def kv_head_shard(num_kv_heads: int, size: int, rank: int) -> Shard:
    """The KV heads rank `rank` of `size` holds (replicated when `size` exceeds them)."""
    if size <= num_kv_heads:
        return even_shard(num_kv_heads, size, rank, "key/value heads (num_key_value_heads)")
    if size % num_kv_heads:
        raise TensorParallelShapeError(
            f"--tensor-parallel-size {size} exceeds the model's {num_kv_heads} key/value heads "
            f"(num_key_value_heads) and is not a multiple of them, so they cannot be replicated evenly"
        )
    return Shard(rank * num_kv_heads // size, 1)


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[Shard, int]:
    """(the checkpoint rows rank `rank` loads, the rows it holds including padding)."""
    per_rank = -(-vocab_size // size)
    start = min(rank * per_rank, vocab_size)
    return Shard(start, min(per_rank, vocab_size - start)), per_rank


def check_model_shape(config: ModelConfig, size: int) -> None:
    """Raise `TensorParallelShapeError` naming the first dimension `size` cannot split."""
    if size < 1:
        raise TensorParallelShapeError(f"--tensor-parallel-size must be >= 1, got {size}")
    even_shard(config.num_heads, size, 0, "attention heads (num_attention_heads)")
    kv_head_shard(config.num_kv_heads, size, 0)
    even_shard(config.intermediate_size, size, 0, "MLP features (intermediate_size)")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (``size == 1``: no group, no collective)."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    """The process group of the ``size`` ranks (gloo on CPU, NCCL/RCCL on GPU); None: the
    default group (``torch.distributed``'s world)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def even(self, total: int, what: str) -> Shard:
        return even_shard(total, self.size, self.rank, what)

    def kv_heads(self, num_kv_heads: int) -> Shard:
        return kv_head_shard(num_kv_heads, self.size, self.rank)

    def vocab(self, vocab_size: int) -> tuple[Shard, int]:
        return vocab_shard(vocab_size, self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (the identity on one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank 0's columns first."""
        if self.size == 1:
            return x
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        gathered = torch.empty((self.size * flat.shape[0], flat.shape[1]), dtype=x.dtype, device=x.device)
        torch.distributed.all_gather_into_tensor(gathered, flat, group=self.group)
        # [size * rows, n] -> [rows, size * n]: rank r's block becomes columns [r * n, (r + 1) * n).
        out = gathered.view(self.size, flat.shape[0], flat.shape[1]).transpose(0, 1)
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE = TensorParallel()
"""One rank: what every model is built with unless the engine runs tensor-parallel."""
