"""Building blocks of the decoder: uninitialised Linear/Embedding, RMSNorm and the gated MLP.

Parameters are created uninitialised: every one of them is replaced by a checkpoint tensor when
the model is built, so random initialisation would be wasted work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b), with W shaped [out_features, in_features] as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        """`weight` reordered for oneDNN (`cpu_linear.pack_linears`), or None: plain F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) with W reordered by ``torch.ops.mkldnn._reorder_linear_weight`` (CPU, oneDNN)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up computed by one fused projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
