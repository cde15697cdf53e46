"""Load a model reference into a ready `CausalLM` (+ tokenizer when the checkpoint has one)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.llama import CausalLM, build_model
from baton_engine.model.loader.reference import ResolvedModel, resolve_model
from baton_engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    source: ResolvedModel


def load_model(
    reference: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    resolved = resolve_model(reference)
    started = time.monotonic()
    log.info(
        "loading %s from %s (%s) onto %s as %s", resolved.name, resolved.path, resolved.format, device, dtype
    )
    if resolved.format == "gguf":
        from baton_engine.model.loader import gguf_loader
        from baton_engine.model.loader.gguf_tokenizer import tokenizer_from_gguf

        reader = gguf_loader.open_gguf(resolved.path)
        config = gguf_loader.read_config(reader, resolved.name)
        weights = gguf_loader.read_weights(reader, config)
        tokenizer: Tokenizer | None = tokenizer_from_gguf(reader)
    else:
        from baton_engine.model.loader import safetensors_loader

        config = safetensors_loader.read_config(resolved.path, resolved.name)
        weights = safetensors_loader.read_weights(resolved.path, config)
        if not config.tie_word_embeddings and "lm_head.weight" not in weights:
            config = dataclasses.replace(config, tie_word_embeddings=True)
        tokenizer = Tokenizer.from_pretrained_dir(resolved.path)
    log.info(
        "read %d weight tensors (%.1f MiB) in %.1f s; building the model",
        len(weights), sum(w.numel() * w.element_size() for w in weights.values()) / 2**20,
        time.monotonic() - started,
    )  # fmt: skip
    model = build_model(config, weights, dtype, device)
    log.info("model %s built in %.1f s", resolved.name, time.monotonic() - started)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=resolved.name, source=resolved)
