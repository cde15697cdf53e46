"""The GPU model runner: fused Triton forward, captured decode graphs, sync-free input staging.

* Inputs go host -> pinned staging buffer -> device with non-blocking copies (two staging sets
  used alternately, each guarded by an event, so a step never overwrites data still in flight).
* Decode-only steps (one token per row) up to the largest captured batch replay a CUDA/HIP graph
  captured for the next larger batch size; padding rows have seq_len 0 and slot -1 (no write).
* Speculative verify steps (decode rows only, some carrying drafts) replay a graph captured for
  a fixed query length Q per row (`verify_batch`): rows are padded to Q tokens and the batch to
  the next captured size, attention is the multi-query decode kernel; the step's logits are
  gathered back in packed order, so sampling and acceptance see what the eager path would give.
* Every other step (prefill chunks, mixed batches) runs eagerly with the varlen
  paged prefill kernel. Nothing reads device memory on the host except the sampler's tokens;
  `sync_debug=True` runs each device step under ``torch.cuda.set_sync_debug_mode("error")``.
* Plain greedy steps take the argmax on the device; after a greedy decode step the predicted
  next step is launched at once (`decode_ahead`), fed the step's tokens on the device, before
  the host waits for them: the device always has the next step queued while the host reads
  tokens and the scheduler plans.
* Single-token decode steps run the fused decode products (`triton_gemv`) inside their
  graphs; `decode_gemv=False` keeps torch's matmul there (the A/B of `bench.gpu`). On NVIDIA
  sm_90+ their kernels launch with programmatic dependent launch (`pdl`: None = where
  supported; False is the A/B), so each kernel's launch overlaps the one before it.
* Structured output: a step's grammar bitmasks go through pinned buffers to the device and are
  applied to the logits with tensor ops after the forward (a graph replay included), before
  the sampler or the argmax. A step with a grammar is never run ahead: its successor's masks
  depend on the tokens it samples.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.model.kernels.triton_attention import PREFILL_BLOCK_M, DecodeWorkspace, decode_num_splits
from baton_engine.model.kernels.triton_gemv import GemvTable
from baton_engine.model.kernels.triton_multi_query import multi_query_workspace
from baton_engine.model.loader.model_loading import LoadedModel
from baton_engine.model.parallel import SINGLE, TensorParallel
from baton_engine.worker.gpu.decode_ahead import AheadPlan, is_decode_only, match_rows, plan_next_decode
from baton_engine.worker.gpu.fused_decoder import DecodeMeta, FusedDecoder, PrefillMeta, VerifyMeta
from baton_engine.worker.gpu.verify_batch import (
    VerifyInputs,
    is_verify_step,
    plan_verify,
    smallest_fit,
    verify_query_lens,
)
from baton_engine.worker.model_runner import ModelRunner
from baton_engine.worker.token_bitmask import apply_token_bitmask

log = logging.getLogger(__name__)

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class _Staging:
    """Pinned host buffers and their device twins for one step's index arrays."""

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, device: torch.device) -> None:
        max_tiles = max_tokens // PREFILL_BLOCK_M + max_rows

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(shape, dtype=dtype, pin_memory=True), torch.zeros(
                shape, dtype=dtype, device=device
            )

        self.input_ids = pair((max_tokens,), torch.int64)
        self.positions = pair((max_tokens,), torch.int64)
        self.slots = pair((max_tokens,), torch.int64)
        self.logits_indices = pair((max_tokens,), torch.int64)
        self.query_start = pair((max_rows + 1,), torch.int32)
        self.seq_lens = pair((max_rows,), torch.int32)
        self.query_lens = pair((max_rows,), torch.int32)
        self.block_tables = pair((max_rows, max_blocks), torch.int32)
        self.tile_rows = pair((max_tiles,), torch.int32)
        self.tile_starts = pair((max_tiles,), torch.int32)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        self.done.record()


def _put(
    pair: tuple[torch.Tensor, torch.Tensor], values: np.ndarray, count: int | None = None
) -> torch.Tensor:
    host, device = pair
    n = len(values) if count is None else count
    host.numpy()[: len(values)] = values
    device[:n].copy_(host[:n], non_blocking=True)
    return device[:n]


def _put_into(host: torch.Tensor, values: np.ndarray, device: torch.Tensor) -> None:
    n = len(values)
    host.numpy()[:n] = values
    device[:n].copy_(host[:n], non_blocking=True)


class _TokenSlot:
    """One step's greedy tokens: on the device (argmax output, row order of its step), their
    pinned host copy, and the event after that copy."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = torch.zeros(rows, dtype=torch.int64, device=device)
        self.host = torch.zeros(rows, dtype=torch.int64, pin_memory=True)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs

    def fill(self, logits: torch.Tensor) -> None:
        """Argmax of `logits` [rows, vocab] into the slot and on to the host (asynchronous)."""
        rows = logits.shape[0]
        torch.argmax(logits, dim=-1, out=self.device[:rows])
        self.host[:rows].copy_(self.device[:rows], non_blocking=True)
        self.done.record()

    def read(self, rows: int, index: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
        """A copy of the first `rows` tokens (or those at `index`), waiting for the device's copy."""
        self.done.synchronize()
        tokens: npt.NDArray[np.int64] = self.host.numpy()[:rows]
        return tokens.copy() if index is None else tokens[index]


class _GrammarStaging:
    """Pinned host buffers and device twins for one step's grammar bitmask and its rows."""

    def __init__(self, max_positions: int, words: int, device: torch.device) -> None:
        self.bitmask = (
            torch.zeros((max_positions, words), dtype=torch.int32, pin_memory=True),
            torch.zeros((max_positions, words), dtype=torch.int32, device=device),
        )
        self.rows = (
            torch.zeros(max_positions, dtype=torch.int64, pin_memory=True),
            torch.zeros(max_positions, dtype=torch.int64, device=device),
        )
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        self.done.record()


@dataclass
class _Ahead:
    plan: AheadPlan
    tokens: _TokenSlot


@dataclass
class _Graph:
    batch: int
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    meta: DecodeMeta | VerifyMeta
    """Held for the graph's lifetime: its split-K workspace was allocated outside the capture,
    and the graph writes to it on every replay (freed, it would be reused or unmapped)."""


class GpuModelRunner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        graph_batch_sizes: tuple[int, ...] | None = None,
        sync_debug: bool = False,
        decode_ahead: bool = True,
        verify_graphs: bool = True,
        decode_gemv: bool = True,
        gemv_table: GemvTable | None = None,
        parallel: TensorParallel = SINGLE,
        pdl: bool | None = None,
    ) -> None:
        super().__init__(config, loaded, parallel=parallel)
        if self.device.type != "cuda":
            raise ValueError(f"GpuModelRunner needs a cuda device, got {self.device}")
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB) on %s",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
            self.device,
        )
        self.sync_debug = sync_debug
        # Decode-ahead launches a step before the scheduler sent it; the other ranks could not
        # follow (their collectives would wait for a step they never got).
        self.decode_ahead = decode_ahead and not parallel.is_parallel
        self._max_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        self.ahead_hits = 0
        self.ahead_misses = 0
        self._ahead: _Ahead | None = None
        # A ring of token slots: the step being read, the ahead step in flight, and one spare
        # (a slot is refilled only after the host has read it).
        self._token_slots = [_TokenSlot(config.max_num_seqs, self.device) for _ in range(3)]
        self._token_turn = 0
        self.fused = FusedDecoder(self.model, gemv_table, decode_gemv, pdl=pdl)
        self.max_tokens = max(
            config.max_num_batched_tokens, config.max_num_seqs * (1 + config.num_speculative_tokens)
        )
        self.max_rows = config.max_num_seqs
        self.max_blocks = -(-config.max_model_len // self.block_size)
        self._staging = [
            _Staging(self.max_tokens, self.max_rows, self.max_blocks, self.device) for _ in range(2)
        ]
        self._turn = 0
        # Allocated on the first step with a grammar (most engines never see one).
        self._grammar_staging: list[_GrammarStaging] = []
        self._grammar_turn = 0
        sizes = DEFAULT_GRAPH_BATCH_SIZES if graph_batch_sizes is None else graph_batch_sizes
        self.graph_sizes = sorted(s for s in sizes if s <= self.max_rows)
        self._graphs: dict[int, _Graph] = {}
        # Static graph inputs: the largest graph's buffers, sliced for smaller ones.
        g = self.graph_sizes[-1] if self.graph_sizes else 0
        dev = self.device
        self._g_ids = torch.zeros(g, dtype=torch.int64, device=dev)
        self._g_pos = torch.zeros(g, dtype=torch.int64, device=dev)
        self._g_slots = torch.full((g,), -1, dtype=torch.int64, device=dev)
        self._g_seq_lens = torch.zeros(g, dtype=torch.int32, device=dev)
        self._g_tables = torch.zeros((g, self.max_blocks), dtype=torch.int32, device=dev)
        self.num_heads = self.fused.num_heads  # this rank's
        # Verify graphs: one per (query length Q, batch size); static inputs sized for the largest.
        k = config.num_speculative_tokens if config.speculative != "none" else 0
        self.verify_query_lens = verify_query_lens(k) if verify_graphs and self.graph_sizes else ()
        self._verify_graphs: dict[tuple[int, int], _Graph] = {}
        self.verify_graph_steps = 0
        vq = self.verify_query_lens[-1] if self.verify_query_lens else 0
        self._v_ids = torch.zeros(g * vq, dtype=torch.int64, device=dev)
        self._v_pos = torch.zeros(g * vq, dtype=torch.int64, device=dev)
        self._v_slots = torch.full((g * vq,), -1, dtype=torch.int64, device=dev)
        self._v_seq_lens = torch.zeros(g if vq else 0, dtype=torch.int32, device=dev)
        self._v_query_lens = torch.zeros(g if vq else 0, dtype=torch.int32, device=dev)
        self._v_tables = torch.zeros((g if vq else 0, self.max_blocks), dtype=torch.int32, device=dev)
        # One logits buffer for all verify graphs (a step reads it before the next replays):
        # per-graph outputs would cost sum(batch sizes) x sum(query lengths) x vocab.
        self._v_logits = torch.empty((g * vq, self.fused.vocab_size), dtype=self.dtype, device=dev)
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the captured graphs reserved
        if self.graph_sizes:
            self._capture()

    # -- graphs ---------------------------------------------------------------------------
    def _decode_meta(self, batch: int) -> DecodeMeta:
        mc = self.model_config
        block_n = self.fused.launch.decode_split.block_n or 64
        splits = decode_num_splits(batch, self.fused.num_kv_heads, self.config.max_model_len, block_n)
        return DecodeMeta(
            block_tables=self._g_tables[:batch],
            seq_lens=self._g_seq_lens[:batch],
            workspace=DecodeWorkspace(batch, self.fused.num_heads, mc.head_dim, splits, self.device),
        )

    def _decode_forward(self, batch: int, meta: DecodeMeta) -> torch.Tensor:
        hidden = self.fused.forward(
            self._g_ids[:batch],
            self._g_pos[:batch],
            self._g_slots[:batch],
            self.kv_cache,
            meta,
            self.kv_scales,
        )
        return self.fused.logits(hidden)

    def _verify_meta(self, batch: int, query_len: int) -> VerifyMeta:
        mc = self.model_config
        # The split count of a plain decode step of `batch` rows: each program's tile holds all
        # query_len tokens of its row, so the programs per split are the same.
        block_n = self.fused.launch.verify_split.block_n or 64
        splits = decode_num_splits(batch, self.fused.num_kv_heads, self.config.max_model_len, block_n)
        return VerifyMeta(
            block_tables=self._v_tables[:batch],
            seq_lens=self._v_seq_lens[:batch],
            query_lens=self._v_query_lens[:batch],
            query_len=query_len,
            workspace=multi_query_workspace(
                batch, query_len, self.fused.num_heads, mc.head_dim, splits, self.device
            ),
        )

    def _verify_forward(self, batch: int, query_len: int, meta: VerifyMeta) -> torch.Tensor:
        n = batch * query_len
        hidden = self.fused.forward(
            self._v_ids[:n], self._v_pos[:n], self._v_slots[:n], self.kv_cache, meta, self.kv_scales
        )
        return self.fused.logits(hidden, out=self._v_logits[:n])

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.perf_counter()
        # Graph capture empties the allocator's cache first; so does this, so the difference
        # below is what the graphs (pools and workspaces) hold, not cache released meanwhile.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for batch in reversed(self.graph_sizes):
                meta = self._decode_meta(batch)
                self._decode_forward(batch, meta)  # compile kernels, warm allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._decode_forward(batch, meta)
                self._graphs[batch] = _Graph(batch, graph, logits, meta)
            for query_len in reversed(self.verify_query_lens):
                for batch in reversed(self.graph_sizes):
                    vmeta = self._verify_meta(batch, query_len)
                    self._verify_forward(batch, query_len, vmeta)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        logits = self._verify_forward(batch, query_len, vmeta)
                    self._verify_graphs[(query_len, batch)] = _Graph(batch, graph, logits, vmeta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info(
            "captured graphs in %.1f s (%.0f MiB): decode for batch sizes %s, verify for query lengths %s",
            self.capture_seconds,
            self.capture_bytes / 2**20,
            self.graph_sizes,
            self.verify_query_lens,
        )

    def _graph_for(self, rows: int) -> _Graph | None:
        for size in self.graph_sizes:
            if size >= rows:
                return self._graphs[size]
        return None

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Greedy steps without drafts or logprobs take the argmax on the device and read only
        the token ids (the same tokens as the sampler's greedy path); all others go through it.
        Greedy decode steps also launch the predicted next step (`decode_ahead`)."""
        ahead, self._ahead = self._ahead, None
        greedy = (
            step.num_tokens > 0
            and len(step.sample_rows) > 0
            and step.sampling.all_greedy
            and not np.any(np.asarray(step.sampling.num_logprobs) >= 0)
        )
        if not greedy:
            return super().execute(step)
        if np.any(np.asarray(step.num_draft_tokens) > 0):
            # Greedy verify: argmax on the device (the sampler's greedy tokens), acceptance on the host.
            logits = self.compute_logits(step)
            self.apply_grammar(logits, step)
            verified = logits.argmax(dim=-1).tolist()
            _, spans = self._expand_sampling(step)
            return self._accept(step, spans, verified, None)
        constrained = step.grammar_bitmask is not None
        index = None
        if ahead is not None and not constrained:
            index = match_rows(ahead.plan, step, self.block_size)
            if index is not None:
                self.ahead_hits += 1
            else:
                self.ahead_misses += 1
        if ahead is not None and index is not None:
            # The step run ahead: its tokens, in the plan's row order, picked by `index`.
            source, rows = ahead.tokens, ahead.plan.num_rows
        else:
            source, index = self._next_token_slot(), None
            logits = self.compute_logits(step)
            self.apply_grammar(logits, step)
            rows = logits.shape[0]
            with self._sync_guard():
                source.fill(logits)
        launched = None
        if self.decode_ahead and is_decode_only(step) and not constrained:
            launched = self._launch_ahead(step, source, index)
        tokens = source.read(rows, index)
        if launched is not None:
            launched.plan.input_ids[:] = tokens
        return ModelRunnerOutput(step_id=step.step_id, sampled_token_array=tokens)

    def _next_token_slot(self) -> _TokenSlot:
        slot = self._token_slots[self._token_turn]
        self._token_turn = (self._token_turn + 1) % len(self._token_slots)
        return slot

    def _launch_ahead(
        self, step: SchedulerOutput, source: _TokenSlot, index: np.ndarray | None
    ) -> _Ahead | None:
        """Replay the graph of the step after `step`, fed the tokens `step` sampled straight from
        `source` on the device (at `index`: the rows of `step` in the slot's row order)."""
        graph = self._graph_for(step.num_rows)
        if graph is None:
            return None
        plan = plan_next_decode(step, self.block_size, self._max_len)
        if plan is None:
            return None
        staging = self._staging[self._turn]
        self._turn ^= 1
        staging.done.synchronize()
        tokens = self._next_token_slot()
        rows = plan.num_rows
        with self._sync_guard():
            self._stage_graph(
                staging, graph, None, plan.positions, plan.slots, plan.seq_lens, plan.block_tables
            )
            if index is None or np.array_equal(index, np.arange(rows)):
                self._g_ids[:rows].copy_(source.device[:rows])
            else:
                device_index = _put(staging.logits_indices, index.astype(np.int64))
                torch.index_select(source.device, 0, device_index, out=self._g_ids[:rows])
            graph.graph.replay()
            tokens.fill(graph.logits[:rows])
            staging.done.record()
        self._ahead = _Ahead(plan, tokens)
        return self._ahead

    def apply_grammar(self, logits: torch.Tensor, step: SchedulerOutput) -> None:
        """The step's grammar bitmasks -> pinned buffer -> device (non-blocking), applied to
        `logits` in place with tensor ops: no host sync."""
        bitmask = step.grammar_bitmask
        if bitmask is None:
            return
        count, words = bitmask.shape
        if not self._grammar_staging:
            max_positions = self.max_rows * (1 + self.config.num_speculative_tokens)
            self._grammar_staging = [_GrammarStaging(max_positions, words, self.device) for _ in range(2)]
        staging = self._grammar_staging[self._grammar_turn]
        self._grammar_turn ^= 1
        staging.done.synchronize()  # the copy of two constrained steps ago
        with self._sync_guard():
            host, device = staging.bitmask
            host.numpy()[:count] = bitmask
            device[:count].copy_(host[:count], non_blocking=True)
            rows = step.grammar_rows
            index = None
            if rows is not None and count != logits.shape[0]:
                index = _put(staging.rows, np.asarray(rows, np.int64))
            apply_token_bitmask(logits, device[:count], index)
            staging.done.record()

    @contextlib.contextmanager
    def _sync_guard(self) -> Iterator[None]:
        if not self.sync_debug:
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def compute_logits(self, step: SchedulerOutput) -> torch.Tensor:
        staging = self._staging[self._turn]
        self._turn ^= 1
        staging.done.synchronize()  # the copies of two steps ago (always finished in practice)
        with self._sync_guard():
            logits = self._run(step, staging)
            staging.done.record()
        return logits

    def _stage_graph(
        self,
        st: _Staging,
        graph: _Graph,
        input_ids: np.ndarray | None,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        tables: np.ndarray,
    ) -> None:
        """Pinned buffers -> the graph's static inputs; padding rows get seq_len 0, slot -1.

        Without `input_ids` the caller fills the rows' ids on the device; padding rows keep
        the ids of an earlier step (any valid id: they write nothing and are never read).
        """
        rows = len(positions)
        pad = graph.batch - rows
        zeros = np.zeros(pad, np.int64)
        if input_ids is not None:
            ids = np.concatenate([np.asarray(input_ids, np.int64), zeros])
            _put_into(st.input_ids[0], ids, self._g_ids)
        _put_into(st.positions[0], np.concatenate([np.asarray(positions, np.int64), zeros]), self._g_pos)
        _put_into(st.slots[0], np.concatenate([np.asarray(slots, np.int64), zeros - 1]), self._g_slots)
        lens = np.concatenate([np.asarray(seq_lens, np.int32), np.zeros(pad, np.int32)])
        _put_into(st.seq_lens[0], lens, self._g_seq_lens)
        width = min(tables.shape[1], self.max_blocks)
        st.block_tables[0].numpy()[:rows, :width] = tables[:, :width]
        self._g_tables[:rows, :width].copy_(st.block_tables[0][:rows, :width], non_blocking=True)

    def _verify_graph_for(self, step: SchedulerOutput) -> tuple[int, int] | None:
        """(query length, batch) of the verify graph that holds `step`, if any."""
        if not self.verify_query_lens or not is_verify_step(step):
            return None
        query_len = smallest_fit(self.verify_query_lens, int(np.max(step.query_lens)))
        batch = smallest_fit(self.graph_sizes, step.num_rows)
        if query_len is None or batch is None:
            return None
        return query_len, batch

    def _stage_verify(self, st: _Staging, inputs: VerifyInputs) -> torch.Tensor:
        """Pinned buffers -> the verify graphs' static inputs; returns the device logits index."""
        _put_into(st.input_ids[0], inputs.input_ids, self._v_ids)
        _put_into(st.positions[0], inputs.positions, self._v_pos)
        _put_into(st.slots[0], inputs.slots, self._v_slots)
        _put_into(st.seq_lens[0], inputs.seq_lens, self._v_seq_lens)
        _put_into(st.query_lens[0], inputs.query_lens, self._v_query_lens)
        rows, width = inputs.block_tables.shape
        st.block_tables[0].numpy()[:rows, :width] = inputs.block_tables
        self._v_tables[:rows, :width].copy_(st.block_tables[0][:rows, :width], non_blocking=True)
        return _put(st.logits_indices, inputs.logits_index)

    def _run(self, step: SchedulerOutput, st: _Staging) -> torch.Tensor:
        verify = self._verify_graph_for(step)
        if verify is not None:
            query_len, batch = verify
            inputs = plan_verify(step, query_len, batch, self.max_blocks)
            index = self._stage_verify(st, inputs)
            verify_graph = self._verify_graphs[verify]
            verify_graph.graph.replay()
            self.verify_graph_steps += 1
            return verify_graph.logits[index]
        rows = step.num_rows
        tokens = step.num_tokens
        query_lens = np.asarray(step.query_lens)
        decode_only = step.num_decode_rows == rows and tokens == rows
        graph = self._graph_for(rows) if decode_only else None
        # The scheduler's table view may be wider than max_model_len needs; the extra columns
        # are never read (seq_lens bounds every row).
        tables = np.asarray(step.block_tables, dtype=np.int32)[:, : self.max_blocks]
        width = tables.shape[1]
        if graph is not None:
            self._stage_graph(
                st, graph, step.input_ids, step.positions, step.slot_mapping, step.seq_lens, tables
            )
            graph.graph.replay()
            return graph.logits[:rows]
        ids = _put(st.input_ids, np.asarray(step.input_ids, np.int64))
        pos = _put(st.positions, np.asarray(step.positions, np.int64))
        slots = _put(st.slots, np.asarray(step.slot_mapping, np.int64))
        qsl = _put(st.query_start, np.asarray(step.query_start_loc, np.int32))
        lens = _put(st.seq_lens, np.asarray(step.seq_lens, np.int32))
        st.block_tables[0].numpy()[:rows, :width] = tables
        block_tables = st.block_tables[1][:rows, :width]
        block_tables.copy_(st.block_tables[0][:rows, :width], non_blocking=True)
        counts = -(-query_lens.astype(np.int64) // PREFILL_BLOCK_M)
        tile_rows = np.repeat(np.arange(rows, dtype=np.int32), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        tile_starts = ((np.arange(len(tile_rows)) - first) * PREFILL_BLOCK_M).astype(np.int32)
        meta = PrefillMeta(
            block_tables=block_tables,
            query_start_loc=qsl,
            seq_lens=lens,
            tile_rows=_put(st.tile_rows, tile_rows),
            tile_starts=_put(st.tile_starts, tile_starts),
        )
        hidden = self.fused.forward(ids, pos, slots, self.kv_cache, meta, self.kv_scales)
        indices = _put(st.logits_indices, np.asarray(step.logits_indices, np.int64))
        return self.fused.logits(hidden[indices])
