"""The interface between the decoder and an attention implementation.

A backend writes the step's new K/V into a layer's paged cache (``[2, num_blocks, block_size,
num_kv_heads, head_dim]``) at `AttentionBatch.slot_mapping`, then computes each row's causal
attention over its cached positions. An FP8 cache comes with the layer's (K, V) scales: values
are stored as ``value / scale`` rounded to FP8 and every row attends over the stored values, its
own step's tokens included, so a prefix hit or a preemption never changes what a row sees.
`prepare` runs once per step (host-side planning shared by all layers); `forward` runs per layer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from baton_engine.model.attention.batch import AttentionBatch


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: AttentionBatch) -> object:
        """Per-step plan handed back to `forward` for every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        batch: AttentionBatch,
        plan: object,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; returns [T, heads, head_dim].

        kv_scale: [2] float32 (K, V) scales of an FP8 `layer_cache`; None for a 16-bit cache."""
        ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` ("torch" is the reference that runs on any device)."""
    from baton_engine.model.attention.torch_backend import TorchAttentionBackend

    if name in ("torch", "auto"):
        return TorchAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
