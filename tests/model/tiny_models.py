"""Tiny random-weight transformers models saved as safetensors directories (float64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 300


def _perturb_norms_and_biases(model: torch.nn.Module, generator: torch.Generator) -> None:
    # transformers initialises norms to 1 and biases to 0; random values make them matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)


def make_tiny_model(family: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Build, save (float64) and return a tiny `family` model: llama | qwen2 | qwen3."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model: torch.nn.Module
    if family == "llama":
        config = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = LlamaForCausalLM(config)
    elif family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000.0})
        model = Qwen2ForCausalLM(config)
    elif family == "qwen3":
        config = Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_theta": 1000.0}
        )
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(family)
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb_norms_and_biases(model, generator)
    model = model.to(torch.float64).eval()
    model.save_pretrained(directory)
    return model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate()` greedy continuation of one prompt (batch of one, no padding)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
