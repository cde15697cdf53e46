"""The model runner: owns the model and the KV cache; turns a `SchedulerOutput` into tokens.

Usage: ``runner = ModelRunner(EngineConfig(...))``; each step ``runner.execute(scheduler_output)``
returns a `ModelRunnerOutput`: forward, the step's grammar bitmasks applied to the logits
(`apply_grammar`), sampling, draft acceptance. The KV cache is one tensor laid out as `contract.KV_LAYOUT`;
`read_blocks` / `write_blocks` move whole blocks for KV transfer.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.model.attention.backend import get_attention_backend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.cpu_linear import pack_linears
from baton_engine.model.loader.model_loading import LoadedModel, load_model
from baton_engine.model.parallel import SINGLE, TensorParallel
from baton_engine.text.tokenizer import Tokenizer
from baton_engine.worker.cpu_step_threads import StepThreadChooser
from baton_engine.worker.distributed import agree_min, rank_device
from baton_engine.worker.kv_cache import (
    allocate_kv_cache,
    default_num_blocks,
    kv_cache_scales,
    resolve_kv_cache_dtype,
)
from baton_engine.worker.sampler import Sampler, SamplingParamsBatch
from baton_engine.worker.token_bitmask import apply_token_bitmask, apply_token_bitmask_host

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`EngineConfig.dtype` as a torch dtype; auto = float32 on CPU, bfloat16 elsewhere."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose one of: auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


class ModelRunner:
    """One rank's runner (`parallel`: its place in the tensor-parallel group; the default is the
    whole model). Every rank runs `compute_logits` on the same steps in the same order (their
    layers' collectives meet); only rank 0 samples (`execute`)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        attention_backend: str = "torch",
        parallel: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.parallel = parallel
        self.device = rank_device(config.device, parallel.rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            loaded = load_model(
                config.model,
                self.device,
                self.dtype,
                parallel=parallel,
                requested_quantization=config.quantization,
                load_tokenizer=parallel.rank == 0,
            )
        self.loaded = loaded
        self.model = self.loaded.model
        weight = self.model.model.embed_tokens.weight
        if weight.dtype != self.dtype or weight.device.type != self.device.type:
            raise ValueError(
                f"the preloaded model is {weight.dtype} on {weight.device}, but the engine is configured "
                f"for {self.dtype} on {self.device}"
            )
        if self.device.type == "cpu":
            pack_linears(self.model)
            for layer in self.model.model.decoder_layers():
                layer.self_attn.rotate_in_place = True
        self.model_config = self.loaded.config
        self.block_size = config.block_size
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.kv_scales = kv_cache_scales(
            self.model_config.num_layers, self.loaded.kv_scales, self.kv_dtype, self.device
        )
        """[layers, 2] (K, V) scales of an FP8 cache; None for a 16-bit one."""
        self.num_kv_heads = self.model.num_local_kv_heads
        """KV heads of this rank's cache (the model's on one rank)."""
        num_blocks = config.num_kv_blocks or default_num_blocks(
            self.model_config,
            self.block_size,
            self.kv_dtype,
            self.device,
            config.gpu_memory_utilization,
            self.num_kv_heads,
        )
        # One scheduler allocates block ids for every rank: they all get the smallest count.
        self.num_blocks = agree_min(num_blocks, parallel, self.device)
        self.kv_cache = allocate_kv_cache(
            self.model_config, self.num_blocks, self.block_size, self.kv_dtype, self.device, self.num_kv_heads
        )
        self.backend = get_attention_backend(attention_backend, self.device)
        self.sampler = Sampler(config.seed, self.device)
        self.step_threads: StepThreadChooser | None = None
        """The intra-op thread count of each small CPU step (None: every step on every thread)."""
        if (
            self.device.type == "cpu"
            and config.cpu_adaptive_threads
            and not parallel.is_parallel
            and torch.get_num_threads() > 1
        ):
            self.step_threads = StepThreadChooser(torch.get_num_threads())

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model supports (the scheduler caps `max_model_len` by it)."""
        return self.model_config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        return tuple(dict.fromkeys(self.model_config.eos_token_ids + tokenizer_eos))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv_cache.index_select(2, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite the given blocks with `data`, shaped as `read_blocks` returns it."""
        expected = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV block data has shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != self.kv_cache.dtype:
            raise ValueError(f"KV block data is {data.dtype}, the cache {self.kv_cache.dtype}")
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        # Byte views: the same copy for every dtype (CPU torch has no FP8 index_copy_).
        self.kv_cache.view(torch.uint8).index_copy_(2, index, data.to(self.device).view(torch.uint8))

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if step.num_tokens == 0:
            return ModelRunnerOutput(step_id=step.step_id, sampled_token_ids=[])
        if self.step_threads is None:
            return self._execute(step)
        threads = self.step_threads.threads_for(step.num_tokens)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            return self._execute(step)
        finally:
            self.step_threads.record(step.num_tokens, threads, time.perf_counter() - start)
            torch.set_num_threads(self.step_threads.all_threads)

    def _execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        logits = self.compute_logits(step)
        if len(step.sample_rows) == 0:
            return ModelRunnerOutput(step_id=step.step_id, sampled_token_ids=[])
        self.apply_grammar(logits, step)
        params, spans = self._expand_sampling(step)
        result = self.sampler.sample(logits, params)
        if not np.any(np.asarray(step.num_draft_tokens) > 0):
            # One token per row: the array form (the scheduler applies it without a per-row pass).
            return ModelRunnerOutput(
                step_id=step.step_id,
                sampled_token_array=np.asarray(result.token_ids, dtype=np.int64),
                logprobs=None if result.logprobs is None else [[row] for row in result.logprobs],
            )
        return self._accept(step, spans, result.token_ids, result.logprobs)

    def compute_logits(self, step: SchedulerOutput) -> torch.Tensor:
        """Run the forward for `step`, writing its KV; logits at `logits_indices` ([N, vocab])."""
        input_ids = torch.from_numpy(np.ascontiguousarray(step.input_ids, dtype=np.int64)).to(self.device)
        batch = AttentionBatch.from_scheduler_output(step, self.block_size, self.device)
        hidden = self.model(input_ids, self.kv_cache, self.backend, batch, self.kv_scales)
        indices = torch.from_numpy(np.ascontiguousarray(step.logits_indices, dtype=np.int64)).to(self.device)
        return self.model.compute_logits(hidden.index_select(0, indices))

    def apply_grammar(self, logits: torch.Tensor, step: SchedulerOutput) -> None:
        """Structured output: set the logits of tokens the step's grammars refuse to -inf, in
        place (`SchedulerOutput.grammar_bitmask`); nothing to do for a step without one."""
        bitmask = step.grammar_bitmask
        if bitmask is None:
            return
        rows = step.grammar_rows
        every_row = rows is None or len(rows) == logits.shape[0]  # ascending, so 0..N-1
        if logits.device.type == "cpu":
            apply_token_bitmask_host(logits, bitmask, None if every_row else rows)
            return
        index = None if every_row or rows is None else torch.from_numpy(rows).to(logits.device)
        apply_token_bitmask(logits, torch.from_numpy(bitmask).to(logits.device), index)

    @staticmethod
    def _expand_sampling(step: SchedulerOutput) -> tuple[SamplingParamsBatch, list[tuple[int, int]]]:
        """Per-row parameters -> per-logits-position; spans[i] = (first position, count) of sample row i."""
        rows = np.asarray(step.sample_rows, dtype=np.int64)
        counts = 1 + np.asarray(step.num_draft_tokens, dtype=np.int64)[rows]
        repeat_rows = np.repeat(rows, counts)
        offsets = np.arange(len(repeat_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        s = step.sampling
        params = SamplingParamsBatch(
            temperature=np.asarray(s.temperature, dtype=np.float32)[repeat_rows],
            top_p=np.asarray(s.top_p, dtype=np.float32)[repeat_rows],
            top_k=np.asarray(s.top_k, dtype=np.int32)[repeat_rows],
            seeds=np.asarray(s.seeds, dtype=np.int64)[repeat_rows],
            output_positions=np.asarray(s.output_positions, dtype=np.int64)[repeat_rows] + offsets,
            num_logprobs=np.asarray(s.num_logprobs, dtype=np.int32)[repeat_rows],
        )
        starts = np.cumsum(counts) - counts
        return params, [(int(a), int(c)) for a, c in zip(starts, counts, strict=True)]

    @staticmethod
    def _accept(
        step: SchedulerOutput,
        spans: list[tuple[int, int]],
        tokens: list[int],
        logprobs: list[list[tuple[int, float]]] | None,
    ) -> ModelRunnerOutput:
        # A speculating row's drafts are accepted while they equal what the target samples at
        # the same output position (with the same position-keyed randomness); the first
        # mismatch is replaced by the target's token. This keeps outputs exactly those of
        # non-speculative decoding.
        sampled: list[list[int]] = []
        row_logprobs: list[list[list[tuple[int, float]]]] = []
        for row, (first, count) in zip(step.sample_rows.tolist(), spans, strict=True):
            end = int(step.query_start_loc[row + 1])
            drafts = step.input_ids[end - count + 1 : end].tolist() if count > 1 else []
            accepted = 1
            while accepted < count and tokens[first + accepted - 1] == drafts[accepted - 1]:
                accepted += 1
            sampled.append(tokens[first : first + accepted])
            if logprobs is not None:
                row_logprobs.append(logprobs[first : first + accepted])
        return ModelRunnerOutput(
            step_id=step.step_id,
            sampled_token_ids=sampled,
            logprobs=row_logprobs if logprobs is not None else None,
        )
