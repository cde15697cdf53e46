"""The GPU runner's verify-step path, eagerly: fixed-query-length layout (`verify_batch`), the
fused forward with the multi-query decode kernel (Triton, on `kernel_device`: compiled on a GPU,
interpreted on the CPU) and the logits gather.

`GpuModelRunner` replays this same forward inside captured graphs (CUDA/HIP only); here it runs
eagerly inside the reference runner, and greedy outputs with speculation on must equal those with
it off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler_output import SchedulerOutput
from baton_engine.model.kernels.triton_multi_query import multi_query_workspace
from baton_engine.model.loader.model_loading import LoadedModel
from baton_engine.worker.gpu.fused_decoder import FusedDecoder, VerifyMeta
from baton_engine.worker.gpu.verify_batch import is_verify_step, plan_verify, smallest_fit, verify_query_lens
from baton_engine.worker.model_runner import ModelRunner
from tests.spec_decode.conftest import TINY_VOCAB
from tests.spec_decode.runs import generate, make_llm

GRAPH_BATCH_SIZES = (1, 2, 4, 8)


class VerifyPathRunner(ModelRunner):
    """Reference runner, except that verify steps take the GPU runner's padded verify forward."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        super().__init__(config, loaded)
        self.fused = FusedDecoder(self.model)
        self.query_lens = verify_query_lens(config.num_speculative_tokens)
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.verify_steps: list[tuple[int, int, int, int]] = []  # (rows, batch, query_len, shortest row)

    def compute_logits(self, step: SchedulerOutput) -> torch.Tensor:
        if not is_verify_step(step):
            return super().compute_logits(step)
        query_len = smallest_fit(self.query_lens, int(np.max(step.query_lens)))
        batch = smallest_fit(GRAPH_BATCH_SIZES, step.num_rows)
        assert query_len is not None and batch is not None
        inputs = plan_verify(step, query_len, batch, self.max_blocks)
        self.verify_steps.append((step.num_rows, batch, query_len, int(np.min(step.query_lens))))
        tables = torch.zeros((batch, self.max_blocks), dtype=torch.int32)
        rows, width = inputs.block_tables.shape
        tables[:rows, :width] = torch.from_numpy(inputs.block_tables)
        mc = self.model_config
        meta = VerifyMeta(
            block_tables=tables.to(self.device),
            seq_lens=self._on_device(inputs.seq_lens),
            query_lens=self._on_device(inputs.query_lens),
            query_len=query_len,
            workspace=multi_query_workspace(batch, query_len, mc.num_heads, mc.head_dim, 1, self.device),
        )
        hidden = self.fused.forward(
            self._on_device(inputs.input_ids),
            self._on_device(inputs.positions),
            self._on_device(inputs.slots),
            self.kv_cache,
            meta,
        )
        logits = torch.empty((len(hidden), mc.vocab_size), dtype=hidden.dtype, device=self.device)
        self.fused.logits(hidden, out=logits)  # the runner's shared logits buffer
        return logits[self._on_device(inputs.logits_index)]

    def _on_device(self, host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(host).to(self.device)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    found = [rng.integers(0, TINY_VOCAB, size=n).tolist() for n in (5, 17, 9, 26)]
    return found + [[3, 4, 5] * 6, [7] * 5]  # 6 rows: the batch pads to a graph size of 8


def test_greedy_identical_through_the_verify_path(
    model_dir: Path, kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both runs take the reference runner, on a GPU too (where the engine would otherwise build
    # `GpuModelRunner` and capture graphs): only the verify steps differ between them.
    monkeypatch.setenv("BATON_GPU_FAST_PATH", "0")
    k = 4
    greedy = SamplingParams(temperature=0, max_tokens=20)
    settings = dict(dtype="float32", max_num_seqs=8, max_model_len=128, device=str(kernel_device))
    off = generate(make_llm(str(model_dir), **settings), prompts(), greedy)
    llm = make_llm(str(model_dir), k=k, **settings)
    runner = VerifyPathRunner(llm.config, llm.core.runner.loaded)  # type: ignore[attr-defined]
    llm.core.runner = runner
    on = generate(llm, prompts(), greedy)
    assert on.token_ids() == off.token_ids()
    assert all(len(tokens) == 20 for tokens in on.token_ids())
    assert on.stats.spec_accepted_tokens > 0
    assert len(runner.verify_steps) > 0
    # Batches padded to a graph size, and rows padded to the window, were both exercised.
    assert any(rows < batch for rows, batch, _, _ in runner.verify_steps)
    assert any(shortest < q for _, _, q, shortest in runner.verify_steps)
    assert {q for _, _, q, _ in runner.verify_steps} <= set(verify_query_lens(k))
