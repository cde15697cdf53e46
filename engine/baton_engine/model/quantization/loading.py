"""What a model's weights are quantized as when it loads, and its checkpoint's KV-cache scales.

The checkpoint decides first: a config.json with an FP8 ``quantization_config`` loads as FP8
whatever was asked. Otherwise ``--quantization fp8`` quantizes the 16-bit weights on load, and
without it the model stays 16-bit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import torch

from baton_engine.model.quantization.fp8 import fp8_dtype_for_device
from baton_engine.model.quantization.fp8_config import parse_quantization_config
from baton_engine.model.quantization.fp8_linear import Fp8Quantization, GemmBackend
from baton_engine.model.weight_source import WeightSource

RequestedQuantization = Literal["fp8"] | None

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def quantization_for(
    hf_config: dict[str, Any] | None,
    requested: RequestedQuantization,
    device: torch.device,
    gemm: GemmBackend = "auto",
) -> Fp8Quantization | None:
    """The model's FP8 layout: its checkpoint's (`hf_config`: config.json, None for GGUF), else
    quantize-on-load when `requested` is "fp8", else None (16-bit)."""
    checkpoint = parse_quantization_config((hf_config or {}).get("quantization_config"))
    if checkpoint is not None:
        return Fp8Quantization(checkpoint, fp8_dtype_for_device(device), gemm)
    if requested == "fp8":
        return Fp8Quantization(None, fp8_dtype_for_device(device), gemm)
    return None


def checkpoint_kv_scales(tensors: Mapping[str, WeightSource], num_layers: int) -> torch.Tensor | None:
    """[layers, 2] calibrated (K, V) scales when the checkpoint has them for every layer:
    ``self_attn.k_scale`` and ``v_scale`` (compressed-tensors), or one ``self_attn.kv_scale`` for
    both (older FP8 checkpoints). None when it has none; a partial set is refused."""
    found: dict[tuple[int, int], float] = {}
    for name, source in tensors.items():
        match = _KV_SCALE.match(name)
        if match is None:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        value = float(source.read().reshape(-1)[0])
        for slot in {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}[kind]:
            found[(layer, slot)] = value
    if not found:
        return None
    missing = [
        f"{layer}.{'kv'[slot]}"
        for layer in range(num_layers)
        for slot in (0, 1)
        if (layer, slot) not in found
    ]
    if missing:
        raise ValueError(f"checkpoint has KV-cache scales for some layers only (missing: {missing[:4]})")
    return torch.tensor([[found[(layer, 0)], found[(layer, 1)]] for layer in range(num_layers)])
