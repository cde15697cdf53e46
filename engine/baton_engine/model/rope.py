"""Rotary position embeddings: a cos/sin table indexed by absolute position.

The table is computed in float32 and cast to the model dtype, as Hugging Face transformers does,
so that float64 runs match transformers bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from baton_engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies (float32, length head_dim / 2), with scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope frequency factors: expected {inv_freq.numel()} values, got {factors.numel()}"
            )
        return inv_freq / factors
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # the two thresholds interpolated.
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryTable(nn.Module):
    """cos/sin for every position up to `max_position_embeddings`, in the model dtype."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin shaped [T, 1, head_dim], broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split convention (first half pairs with second)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rotary`'s result written into `x` ([T, heads, head_dim], any strides: e.g. q and k
    side by side in the qkv projection's output), bit for bit the same: each half's products
    are rounded as there, and ``a + (-b) * s`` equals ``a - b * s`` exactly. Half the passes over
    memory and no temporaries of x's full size (`apply_rotary` allocates five)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    first_sin = first * sin[..., half:]
    second_sin = second * sin[..., :half]
    first.mul_(cos[..., :half]).sub_(second_sin)
    second.mul_(cos[..., half:]).add_(first_sin)
