"""Building blocks of the decoder: RMSNorm and the gated MLP (parallel linears: `linear.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.config import ModelConfig
from baton_engine.model.linear import (
    ColumnParallelLinear,
    LinearMethod,
    QuantizationConfig,
    RowParallelLinear,
    method_for,
    onednn_linear,
    onednn_rows,
)
from baton_engine.model.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class BuildContext:
    """What every layer of one model is built with."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device | str
    parallel: TensorParallel = SINGLE
    quantization: QuantizationConfig | None = None

    def linear(self, prefix: str) -> LinearArgs:
        """The keyword arguments of a parallel linear layer named `prefix`."""
        return {
            "prefix": prefix,
            "dtype": self.dtype,
            "device": self.device,
            "parallel": self.parallel,
            "quant_method": method_for(self.quantization, prefix),
        }


class LinearArgs(TypedDict):
    prefix: str
    dtype: torch.dtype
    device: torch.device | str
    parallel: TensorParallel
    quant_method: LinearMethod | None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): gate and up in one column-parallel projection (each rank
    holds its share of both, side by side), down row-parallel (one all-reduce)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        *,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size,
            (intermediate_size, intermediate_size),
            bias=bias,
            dtype=dtype,
            device=device,
            parallel=parallel,
            part_names=("gate_proj", "up_proj"),
            prefix=f"{prefix}.gate_up_proj",
            quant_method=method_for(quantization, f"{prefix}.gate_up_proj"),
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            dtype=dtype,
            device=device,
            parallel=parallel,
            prefix=f"{prefix}.down_proj",
            quant_method=method_for(quantization, f"{prefix}.down_proj"),
        )

        self.gate_packed: torch.Tensor | None = None
        self.up_packed: torch.Tensor | None = None
        """This rank's gate and up weights, each reordered for oneDNN (CPU: `cpu_linear`), or None.
        Two plain matmuls with contiguous outputs, then silu and the product in place. oneDNN's
        swish and multiply post-ops would save that pass over memory, but on an AVX2 EPYC (Zen 3)
        they made the matmuls 7-20 % slower from 32 rows up (equal below) and a prefill-heavy
        offline run 7.6 % slower end to end; on an AVX-512 one the two forms ran equal."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), plus `residual` when given."""
        out: torch.Tensor
        if self.gate_packed is not None and self.up_packed is not None:
            # Padded to the oneDNN row bucket once for the three matmuls (each would pad and cut
            # its own operands: copies of the [tokens, intermediate] product between them).
            rows = x.shape[0]
            padded = onednn_rows(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
                residual = None if residual is None else F.pad(residual, (0, 0, 0, padded - rows))
            bias = self.gate_up_proj.bias
            gate_bias, up_bias = (None, None) if bias is None else bias.chunk(2)
            gate = onednn_linear(x, self.gate_packed, gate_bias)
            up = onednn_linear(x, self.up_packed, up_bias)
            out = self.down_proj(F.silu(gate, inplace=True).mul_(up), residual)
            return out if padded == rows else out[:rows]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up, residual)
        return out
