"""Hugging Face safetensors directories: config.json, *.safetensors shards, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from baton_engine.model.config import ModelConfig
from baton_engine.model.loader.hf_config import model_config_from_hf


def read_config(directory: Path, name: str = "") -> ModelConfig:
    return model_config_from_hf(json.loads((directory / "config.json").read_text()), name)


def read_weights(directory: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of every shard (CPU), named as in the checkpoint."""
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} holds no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard), device="cpu"))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights
