"""Checkpoint weights (Hugging Face names) -> this decoder's parameters.

Q/K/V projections are fused into one `qkv_proj` and gate/up into one `gate_up_proj`, so each
layer runs three matrix products fewer per step.
"""

from __future__ import annotations

import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.moe import stack_expert_weights

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_checkpoint_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    fused = stack_expert_weights(weights, config)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for target, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                present = [name in fused for name in names]
                if not any(present):
                    continue
                if not all(present):
                    missing = [n for n, p in zip(names, present, strict=True) if not p]
                    raise ValueError(
                        f"checkpoint lacks {len(missing)} weights the model needs, e.g. {missing[:3]}"
                    )
                fused[f"{prefix}{target}.{kind}"] = torch.cat([fused.pop(name) for name in names], dim=0)
    return fused
