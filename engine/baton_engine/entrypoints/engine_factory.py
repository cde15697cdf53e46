"""Build an `EngineCore` (model runner + scheduler) or just a tokenizer from an `EngineConfig`.

The server process needs only the tokenizer (it never loads weights); the core process and
the offline `LLM` build the whole core.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import Drafter, EngineCore, KVEventSink, SpecDecodeStatsLogger
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.cpu_allocator import tune_cpu_allocator
from baton_engine.entrypoints.cpu_layout import host_cpu_layout
from baton_engine.prefix.hashing import prefix_hasher
from baton_engine.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from baton_engine.model.loader.model_loading import LoadedModel
    from baton_engine.model.parallel import TensorParallel
    from baton_engine.text.tokenizer import Tokenizer
    from baton_engine.worker.model_runner import ModelRunner
    from baton_engine.worker.tp_executor import TensorParallelExecutor


@dataclass
class ModelInfo:
    """What an engine knows about its model once loaded (the core process reports it as ready)."""

    name: str
    """The name clients use (`served_model_name`, else the model's own)."""
    max_model_len: int
    """The configured limit capped by the model's own (`max_position_embeddings`)."""
    eos_token_ids: tuple[int, ...]
    """The model's EOS ids (config, else tokenizer); the first is the scheduler's EOS."""
    vocab_size: int
    tokenizer: Tokenizer | None = None
    """The checkpoint's own tokenizer, when it has one (the offline `LLM` uses it)."""

    def with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """The scheduler knows one EOS id; models with several stop on the others through
        `stop_token_ids` (unless the request ignores EOS)."""
        extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)


def build_engine_core(
    config: EngineConfig,
    *,
    kv_event_sink: KVEventSink | None = None,
    loaded: LoadedModel | None = None,
    on_rank_failure: Callable[[str], None] | None = None,
) -> tuple[EngineCore, ModelInfo]:
    """`on_rank_failure(message)`: with tensor parallelism, what to do when a rank fails (the
    core process exits through it); None raises `RankFailure` from the next step instead."""
    from baton_engine.core.scheduler import Scheduler

    executor: TensorParallelExecutor | None = None
    if config.tensor_parallel_size > 1:
        if loaded is not None:
            raise ValueError("a preloaded model cannot be split: tensor_parallel_size must be 1")
        executor = start_tensor_parallel(config, on_rank_failure)
        runner = executor.runner
    else:
        runner = build_model_runner(config, loaded)
    model_config = runner.model_config
    max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
    tokenizer = runner.loaded.tokenizer
    eos_ids = tuple(model_config.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer is not None else ())
    speculative_k = config.num_speculative_tokens if config.speculative != "none" else 0
    name = config.served_model_name or runner.loaded.name
    connector = None
    if config.kv_role != "none":
        from baton_engine.kv_transfer.connector import KVTransferConnector

        connector = KVTransferConnector(
            config,
            runner.kv_cache,
            model_name=name,
            num_kv_heads=model_config.num_kv_heads,
            ranks=executor,
        )
        if executor is not None:
            executor.kv_result_handler = connector.on_rank_result
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
        kv_connector=connector,
        structured_output=structured_output,
        # The GPU runner runs decode steps ahead: with the next blocks handed out a step early,
        # also where a row's next token opens a block.
        decode_lookahead=bool(getattr(runner, "decode_ahead", False)),
    )
    info = ModelInfo(
        name=name,
        max_model_len=max_model_len,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
        tokenizer=tokenizer,
    )
    drafter, spec_stats_logger = _drafter(config)
    core = EngineCore(
        scheduler,
        runner if executor is None else executor,
        kv_event_sink=kv_event_sink,
        drafter=drafter,
        spec_stats_logger=spec_stats_logger,
    )
    return core, info


def close_runner(core: EngineCore) -> None:
    """Stop `core`'s tensor-parallel ranks, if it has any, and its grammar compile thread."""
    from baton_engine.worker.tp_executor import TensorParallelExecutor

    if isinstance(core.runner, TensorParallelExecutor):
        core.runner.close()
    if core.scheduler.structured_output is not None:
        core.scheduler.structured_output.close()


def check_parallel_config(config: EngineConfig) -> None:
    """Refuse a tensor-parallel size the model or the visible devices cannot take (raises
    ValueError naming the dimension or the device count), before any process starts."""
    if config.tensor_parallel_size == 1:
        return
    from baton_engine.model.loader.model_loading import read_model_config
    from baton_engine.model.parallel import check_model_shape
    from baton_engine.worker.distributed import check_devices

    check_model_shape(read_model_config(config.model), config.tensor_parallel_size)
    check_devices(config.device, config.tensor_parallel_size)


def start_tensor_parallel(
    config: EngineConfig, on_rank_failure: Callable[[str], None] | None = None
) -> TensorParallelExecutor:
    """Rank 0 in this process, ranks 1..N-1 as `rank_process` children, all loaded and ready."""
    from baton_engine.worker.tp_executor import TensorParallelExecutor

    check_parallel_config(config)
    return TensorParallelExecutor(
        config,
        [sys.executable, "-m", "baton_engine.entrypoints.rank_process"],
        lambda parallel: build_model_runner(config, parallel=parallel),
        on_fatal=on_rank_failure,
    )


def build_model_runner(
    config: EngineConfig, loaded: LoadedModel | None = None, parallel: TensorParallel | None = None
) -> ModelRunner:
    """The GPU runner (Triton kernels, captured decode graphs) on cuda/ROCm devices unless
    ``BATON_GPU_FAST_PATH=0``; the reference runner everywhere else, on CPU with this process's
    allocator tuned for its steps (`tune_cpu_allocator`). `parallel`: the rank's place in its
    tensor-parallel group (default: the whole model)."""
    import torch

    from baton_engine.model.parallel import SINGLE
    from baton_engine.worker.model_runner import ModelRunner

    tp = SINGLE if parallel is None else parallel
    device_type = torch.device(config.device).type
    if device_type == "cuda" and os.environ.get("BATON_GPU_FAST_PATH", "1") != "0":
        from baton_engine.worker.gpu.model_runner import GpuModelRunner

        return GpuModelRunner(config, loaded, parallel=tp)
    if device_type == "cpu":
        tune_cpu_allocator()
    if tp.is_parallel and device_type == "cpu":
        # The ranks share the host's cores: one rank's intra-op threads must not take them all.
        usable = host_cpu_layout(config.cpu_threads, "none").core_threads
        torch.set_num_threads(max(1, usable // tp.size))
    return ModelRunner(config, loaded, parallel=tp)


def _drafter(config: EngineConfig) -> tuple[Drafter | None, SpecDecodeStatsLogger | None]:
    if config.speculative == "none":
        return None, None
    from baton_engine.spec_decode.drafter import NgramDrafter
    from baton_engine.spec_decode.ngram_proposer import NgramProposer
    from baton_engine.spec_decode.stats_log import SpecDecodeLogger

    proposer = NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    return NgramDrafter(proposer), SpecDecodeLogger()
