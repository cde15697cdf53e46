"""Verify graphs at the Llama-3.2-1B attention geometry (32 heads, 8 kv heads, head_dim 64):
the graph path against the eager path on the same step, after the allocator released its cache.

The release is the regression: graphs once dropped their split-K workspace after capture, and a
workspace in a segment of its own was unmapped by the next ``empty_cache`` (every capture starts
with one), so the next replay faulted with an illegal memory access.
"""

from __future__ import annotations

import gc

import pytest
import torch

from baton_engine.worker.gpu.model_runner import GpuModelRunner
from bench.speculative import _build_runner
from tests.gpu_kernels.verify_steps import verify_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SHAPE = dict(
    family="llama",
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    name="wide-attention-2-layers",
)
BLOCK = 16


def test_verify_graph_matches_eager_after_the_allocator_releases_its_cache() -> None:
    settings = dict(
        max_num_seqs=8,
        max_model_len=512,
        max_num_batched_tokens=512,
        block_size=BLOCK,
        num_kv_blocks=8 * 8,
        speculative="ngram",
        num_speculative_tokens=8,
    )
    runner, _ = _build_runner(SHAPE, "cuda", "bfloat16", settings)
    assert isinstance(runner, GpuModelRunner)
    assert runner.verify_query_lens == (2, 3, 5, 9)
    runner.kv_cache.zero_()
    gc.collect()
    torch.cuda.empty_cache()  # unmaps every segment nothing holds any more

    # 8 rows of 1 + 8 drafts (the (9, 8) graph, whose workspace is 2.9 MB: a segment of its own),
    # then 8 rows of 1 + 3 drafts in a 5-token window (rows padded inside the window).
    tables = [list(range(8 * row, 8 * row + 8)) for row in range(8)]
    for drafts, lens in ((8, [40 + 9 * r for r in range(8)]), (3, [100 + r for r in range(8)])):
        step = verify_step(lens, [drafts] * 8, tables, BLOCK)
        before = runner.verify_graph_steps
        graph_logits = runner.compute_logits(step).float()
        assert runner.verify_graph_steps == before + 1
        query_lens, runner.verify_query_lens = runner.verify_query_lens, ()
        try:
            eager_logits = runner.compute_logits(step).float()  # the varlen prefill kernel
        finally:
            runner.verify_query_lens = query_lens
        torch.cuda.synchronize()
        assert graph_logits.shape == (8 * (drafts + 1), SHAPE["vocab_size"])
        assert bool(torch.isfinite(graph_logits).all())
        error = float((graph_logits - eager_logits).norm() / eager_logits.norm())
        assert error < 2e-2, error
