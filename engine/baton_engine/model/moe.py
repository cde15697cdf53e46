"""The sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a top-k router and E gated MLPs.

Routing, exactly as transformers does it for both families: router logits ``x W_g^T`` in the
model dtype, softmax over all experts in float32, the top k probabilities, renormalised to sum to
1 when `MoeConfig.norm_topk_prob` (always for Mixtral; Qwen3-MoE's config says), then cast back to
the model dtype unless `MoeConfig.routing_in_float32` (Mixtral keeps them in float32, so the
expert output is scaled in float32 before it is summed in the model dtype). Neither family has a
shared expert.

The experts' weights are stacked: ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows)
and ``experts.down_proj`` [E, H, I], as transformers 5 holds them. Two paths compute the block:
`experts_reference` (torch; CPU and tests: the pairs sorted by expert, one product per expert that
has pairs, summed in expert order as transformers does) and `kernels.triton_moe.fused_moe` (GPU:
grouped GEMMs, no loop over experts on the host).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.config import ModelConfig, MoeConfig

#: Which implementation computes the experts: the torch reference, or the Triton kernels
#: ("auto": Triton on GPU devices, the reference elsewhere).
MoeImplementation = Literal["auto", "torch", "triton"]


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, config: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, K], expert ids [T, K]) of each token (see the module docstring)."""
    logits = F.linear(hidden, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not config.routing_in_float32:
        weights = weights.to(logits.dtype)
    return weights, ids


def experts_reference(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Each token's routed experts' outputs, weighted and summed: [T, H] (16/32-bit weights)."""
    out = torch.zeros_like(hidden)
    num_experts = gate_up.shape[0]
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden[tokens], gate_up[expert]).chunk(2, dim=-1)
        result = F.linear(F.silu(gate) * up, down[expert])
        result = result * weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, result.to(out.dtype))
    return out


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class StackedExperts(nn.Module):
    """E gated MLPs as two stacked weights (16-bit, or FP8 with per-(expert, channel) scales)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_scale is not None

    def set_fp8(
        self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor
    ) -> None:
        """Replace the weights by FP8 ones: scales [E, 2I] and [E, H] (float32)."""
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.gate_up_scale = gate_up_scale
        self.down_scale = down_scale

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in `dtype` (FP8 weights dequantized; the reference path's operands)."""
        if self.gate_up_scale is None or self.down_scale is None:
            return self.gate_up_proj, self.down_proj
        gate_up = (self.gate_up_proj.to(torch.float32) * self.gate_up_scale[..., None]).to(dtype)
        down = (self.down_proj.to(torch.float32) * self.down_scale[..., None]).to(dtype)
        return gate_up, down


class SparseMoeBlock(nn.Module):
    """Router + experts; module names follow the checkpoints (``mlp.gate``, ``mlp.experts``)."""

    def __init__(
        self, hidden_size: int, config: MoeConfig, implementation: MoeImplementation = "auto"
    ) -> None:
        super().__init__()
        self.config = config
        self.implementation = implementation
        self.gate = TopKRouter(config.num_experts, hidden_size)
        self.experts = StackedExperts(config.num_experts, hidden_size, config.moe_intermediate_size)

    def uses_triton(self, device: torch.device) -> bool:
        if self.implementation == "auto":
            return device.type == "cuda"
        return self.implementation == "triton"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(hidden, self.gate.weight, self.config)
        experts = self.experts
        if self.uses_triton(hidden.device):
            from baton_engine.model.kernels.triton_moe import fused_moe

            return fused_moe(
                hidden, experts.gate_up_proj, experts.down_proj, weights, ids,
                experts.gate_up_scale, experts.down_scale,
            )  # fmt: skip
        gate_up, down = experts.dequantized(hidden.dtype)
        return experts_reference(hidden, gate_up, down, weights, ids)


#: Checkpoint module names of expert `{e}`'s gate, up and down projections and of the router,
#: under a sparse layer's prefix (``model.layers.N.``), per family.
CHECKPOINT_NAMES: dict[str, tuple[str, str, str, str]] = {
    "qwen3_moe": (
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
        "mlp.gate",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
        "block_sparse_moe.gate",
    ),
}


def stack_expert_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> the stacked ``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I], and the router as ``mlp.gate.weight``, for every sparse
    layer (other tensors pass through, and so do layers already stacked: transformers 5's
    in-memory names)."""
    if config.moe is None:
        return weights
    gate_name, up_name, down_name, router_name = CHECKPOINT_NAMES[config.family]
    stacked = dict(weights)

    def take(prefix: str, name: str, expert: int) -> torch.Tensor:
        key = f"{prefix}{name.format(e=expert)}.weight"
        if key not in stacked:
            raise ValueError(f"checkpoint lacks {key} (expert {expert} of {prefix.rstrip('.')})")
        return stacked.pop(key)

    for layer in config.moe.sparse_layers:
        prefix = f"model.layers.{layer}."
        if f"{prefix}mlp.experts.gate_up_proj" in stacked:
            continue
        experts = range(config.moe.num_experts)
        gate_up = [torch.cat([take(prefix, gate_name, e), take(prefix, up_name, e)]) for e in experts]
        stacked[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        down = [take(prefix, down_name, e) for e in experts]
        stacked[f"{prefix}mlp.experts.down_proj"] = torch.stack(down)
        router = f"{prefix}{router_name}.weight"
        if router in stacked:
            stacked[f"{prefix}mlp.gate.weight"] = stacked.pop(router)
    return stacked
