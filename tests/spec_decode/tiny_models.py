"""Tiny random-weight Llama models for speculative-decoding tests (safetensors directories).

Random weights decode greedily into short loops, which is what n-gram drafts feed on: drafts
are accepted often enough to exercise long accepted runs, and rejected often enough to exercise
rollback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tiny_llama(
    directory: Path,
    *,
    vocab_size: int = 64,
    seed: int = 0,
    init_range: float = 0.2,
    eos_token_id: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
) -> Path:
    """Save a float64 tiny Llama (no tokenizer: prompts are token ids) and return its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=init_range,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.save_pretrained(directory)
    return directory


def with_eos(source: Path, target: Path, eos_token_id: int) -> Path:
    """A copy of model `source` (same weights, linked) whose config names `eos_token_id` as EOS."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (target / "config.json").write_text(json.dumps(config))
    return target
