"""Load a model reference into a ready `CausalLM` (+ tokenizer when the checkpoint has one).

With tensor parallelism each rank calls `load_model` with its `TensorParallel`: checkpoint
tensors are read lazily and every layer keeps only the rank's shard.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.linear import QuantizationConfig
from baton_engine.model.llama import CausalLM, build_model
from baton_engine.model.loader.reference import ResolvedModel, resolve_model
from baton_engine.model.parallel import SINGLE, TensorParallel
from baton_engine.model.quantization.loading import (
    RequestedQuantization,
    checkpoint_kv_scales,
    quantization_for,
)
from baton_engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    source: ResolvedModel
    kv_scales: torch.Tensor | None = None
    """[layers, 2] calibrated (K, V) scales for an FP8 KV cache, when the checkpoint has them."""


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters on this rank."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def read_model_config(reference: str) -> ModelConfig:
    """The model's hyper-parameters alone (no tensor read)."""
    resolved = resolve_model(reference)
    if resolved.format == "gguf":
        from baton_engine.model.loader import gguf_loader

        return gguf_loader.read_config(gguf_loader.open_gguf(resolved.path), resolved.name)
    from baton_engine.model.loader import safetensors_loader

    return safetensors_loader.read_config(resolved.path, resolved.name)


def load_model(
    reference: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parallel: TensorParallel = SINGLE,
    quantization: QuantizationConfig | None = None,
    requested_quantization: RequestedQuantization = None,
    load_tokenizer: bool = True,
) -> LoadedModel:
    """`load_tokenizer=False`: skip the tokenizer (tensor-parallel ranks other than 0 need none).

    `quantization` None: the checkpoint's FP8 layout if its config.json has one, else
    `requested_quantization` ("fp8": quantize on load; None: 16-bit)."""
    kv_scales: torch.Tensor | None = None
    resolved = resolve_model(reference)
    started = time.monotonic()
    rank = f" (tensor-parallel rank {parallel.rank} of {parallel.size})" if parallel.is_parallel else ""
    log.info(
        "loading %s from %s (%s) onto %s as %s%s",
        resolved.name, resolved.path, resolved.format, device, dtype, rank,
    )  # fmt: skip
    tokenizer: Tokenizer | None = None
    if resolved.format == "gguf":
        from baton_engine.model.loader import gguf_loader

        reader = gguf_loader.open_gguf(resolved.path)
        config = gguf_loader.read_config(reader, resolved.name)
        sources = gguf_loader.weight_sources(reader, config)
        if quantization is None:
            quantization = quantization_for(None, requested_quantization, torch.device(device))
        model = build_model(config, sources, dtype, device, parallel=parallel, quantization=quantization)
        if load_tokenizer:
            from baton_engine.model.loader.gguf_tokenizer import tokenizer_from_gguf

            tokenizer = tokenizer_from_gguf(reader)
    else:
        from baton_engine.model.loader import safetensors_loader

        config = safetensors_loader.read_config(resolved.path, resolved.name)
        if quantization is None:
            raw = safetensors_loader.read_raw_config(resolved.path)
            quantization = quantization_for(raw, requested_quantization, torch.device(device))
        with safetensors_loader.open_weights(resolved.path) as named:
            kv_scales = checkpoint_kv_scales(named, config.num_layers)
            if config.tie_word_embeddings:
                named.pop("lm_head.weight", None)
            elif "lm_head.weight" not in named:
                config = dataclasses.replace(config, tie_word_embeddings=True)
            model = build_model(
                config, named.items(), dtype, device, parallel=parallel, quantization=quantization
            )
        if load_tokenizer:
            tokenizer = Tokenizer.from_pretrained_dir(resolved.path)
    log.info(
        "model %s built in %.1f s: %.1f MiB of parameters on this rank%s",
        resolved.name, time.monotonic() - started, parameter_bytes(model) / 2**20, rank,
    )  # fmt: skip
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        name=resolved.name,
        source=resolved,
        kv_scales=kv_scales,
    )
