"""Build an `EngineCore` (model runner + scheduler) or just a tokenizer from an `EngineConfig`.

The server process needs only the tokenizer (it never loads weights); the core process and
the offline `LLM` build the whole core.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import Drafter, EngineCore, KVEventSink
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.prefix.hashing import prefix_hasher
from baton_engine.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from baton_engine.model.loader.model_loading import LoadedModel
    from baton_engine.worker.model_runner import ModelRunner


@dataclass
class ModelInfo:
    name: str
    """The name clients use (`served_model_name`, else the model's own)."""
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """The scheduler knows one EOS id; models with several stop on the others through
        `stop_token_ids` (unless the request ignores EOS)."""
        extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)


def build_engine_core(
    config: EngineConfig, *, kv_event_sink: KVEventSink | None = None, loaded: LoadedModel | None = None
) -> tuple[EngineCore, ModelInfo]:
    from baton_engine.core.scheduler import Scheduler

    runner = build_model_runner(config, loaded)
    model_config = runner.model_config
    max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
    tokenizer = runner.loaded.tokenizer
    eos_ids = tuple(model_config.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer is not None else ())
    speculative_k = config.num_speculative_tokens if config.speculative != "none" else 0
    structured_output = None
    if tokenizer is not None:
        # llguidance stops on every EOS the model has (the scheduler's, and the tokenizer's).
        grammar_eos = tuple(dict.fromkeys(eos_ids + tokenizer.eos_token_ids))
        structured_output = StructuredOutputManager(
            tokenizer.backend.to_str, model_config.vocab_size, grammar_eos
        )
    scheduler = Scheduler.from_config(
        config.model_copy(update={"max_model_len": max_model_len, "num_speculative_tokens": speculative_k}),
        num_blocks=runner.num_blocks,
        eos_token_id=eos_ids[0] if eos_ids else None,
        prefix_hasher=prefix_hasher(config.prefix_hash, config.prefix_hash_seed),
        structured_output=structured_output,
    )
    info = ModelInfo(
        name=config.served_model_name or runner.loaded.name,
        max_model_len=max_model_len,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
    )
    connector = None
    if config.kv_role != "none":
        from baton_engine.kv_transfer.connector import KVTransferConnector

        connector = KVTransferConnector(config, runner.kv_cache, scheduler, model_name=info.name)
    core = EngineCore(
        scheduler, runner, kv_event_sink=kv_event_sink, kv_connector=connector, drafter=_drafter(config)
    )
    return core, info


def build_model_runner(config: EngineConfig, loaded: LoadedModel | None = None) -> ModelRunner:
    """The GPU runner (Triton kernels, captured decode graphs) on cuda/ROCm devices unless
    ``BATON_GPU_FAST_PATH=0``; the reference runner everywhere else."""
    import torch

    from baton_engine.worker.model_runner import ModelRunner

    if torch.device(config.device).type == "cuda" and os.environ.get("BATON_GPU_FAST_PATH", "1") != "0":
        from baton_engine.worker.gpu.model_runner import GpuModelRunner

        return GpuModelRunner(config, loaded)
    return ModelRunner(config, loaded)


def _drafter(config: EngineConfig) -> Drafter | None:
    if config.speculative == "none":
        return None
    from baton_engine.spec_decode.drafter import NgramDrafter
    from baton_engine.spec_decode.ngram_proposer import NgramProposer
    from baton_engine.spec_decode.stats_log import SpecDecodeLogger

    proposer = NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    return NgramDrafter(proposer, logger=SpecDecodeLogger())
