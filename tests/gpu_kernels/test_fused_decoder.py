"""The fused Triton forward (on `kernel_device`) against the reference decoder, step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.model.attention.backend import get_attention_backend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.kernels.triton_attention import DecodeWorkspace, prefill_tiles
from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.moe import SparseMoeBlock
from baton_engine.worker.gpu.fused_decoder import DecodeMeta, FusedDecoder, PrefillMeta
from baton_engine.worker.kv_cache import allocate_kv_cache
from baton_support.tiny_models import parity_model

BLOCK = 4


def _batch(
    prompt_lens: list[int], context: list[int], tables: np.ndarray, device: torch.device
) -> AttentionBatch:
    query_lens = [p - c for p, c in zip(prompt_lens, context, strict=True)]
    positions = np.concatenate([np.arange(c, p) for p, c in zip(prompt_lens, context, strict=True)])
    rows = np.repeat(np.arange(len(prompt_lens)), query_lens)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    return AttentionBatch(
        block_size=BLOCK,
        num_decode_rows=sum(q == 1 for q in query_lens),
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64),
        seq_lens=np.asarray(prompt_lens, dtype=np.int64),
        num_computed_tokens=np.asarray(context, dtype=np.int64),
        positions_host=positions.astype(np.int64),
        block_tables_host=tables.astype(np.int64),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(device),
        positions=torch.from_numpy(positions.astype(np.int64)).to(device),
    )


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
        "qwen3_moe",
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_prefill_then_decode_matches_reference(
    family: str, tmp_path: Path, kernel_device: torch.device
) -> None:
    _prefill_then_decode(family, torch.float32, tmp_path, kernel_device)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_kv_cache_matches_reference(
    fmt: torch.dtype, tmp_path: Path, kernel_device: torch.device
) -> None:
    """Both decoders store K/V as FP8 (per-layer scales) and attend over the stored values."""
    _prefill_then_decode("qwen3", fmt, tmp_path, kernel_device)


def _prefill_then_decode(
    family: str, kv_dtype: torch.dtype, tmp_path: Path, kernel_device: torch.device
) -> None:
    parity_model(family).save(tmp_path / family)
    loaded = load_model(str(tmp_path / family), kernel_device, torch.float32)
    model, config = loaded.model, loaded.config
    kv_scales = None
    if kv_dtype != torch.float32:  # distinct scales per layer, K and V
        kv_scales = torch.tensor([[0.5 + 0.25 * i, 2.0 - 0.5 * i] for i in range(config.num_layers)])
        kv_scales = kv_scales.to(kernel_device)
    moe_blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert bool(moe_blocks) == (config.moe is not None)
    ref_cache = allocate_kv_cache(config, 16, BLOCK, kv_dtype, kernel_device)
    fast_cache = torch.zeros_like(ref_cache.view(torch.uint8)).view(kv_dtype)
    backend = get_attention_backend("torch", kernel_device)
    fused = FusedDecoder(model)
    tables = np.array([[3, 7, 1, 0], [2, 9, 4, 5]])
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, config.vocab_size, size=n).tolist() for n in (6, 11)]
    seqs = [list(p) for p in prompts]
    context = [0, 0]
    for step in range(3):
        lens = [len(s) for s in seqs]
        batch = _batch(lens, context, tables, kernel_device)
        ids = torch.tensor(
            [t for s, c in zip(seqs, context, strict=True) for t in s[c:]], device=kernel_device
        )
        with torch.no_grad():
            for block in moe_blocks:  # the reference experts for the reference decoder
                block.implementation = "torch"
            ref = model(ids, ref_cache, backend, batch, kv_scales)
            for block in moe_blocks:  # the fused decoder's experts: Triton's grouped GEMMs
                block.implementation = "triton"
            qlens = [n - c for n, c in zip(lens, context, strict=True)]
            bt = torch.from_numpy(tables.astype(np.int32)).to(kernel_device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=kernel_device)
            if step == 0:
                tile_rows, tile_starts = prefill_tiles(qlens)
                meta: DecodeMeta | PrefillMeta = PrefillMeta(
                    bt,
                    torch.tensor(batch.query_start_loc, dtype=torch.int32, device=kernel_device),
                    seq_lens,
                    torch.tensor(tile_rows, dtype=torch.int32, device=kernel_device),
                    torch.tensor(tile_starts, dtype=torch.int32, device=kernel_device),
                )
            else:
                meta = DecodeMeta(
                    bt, seq_lens, DecodeWorkspace(2, config.num_heads, config.head_dim, 2, bt.device)
                )
            out = fused.forward(ids, batch.positions, batch.slot_mapping, fast_cache, meta, kv_scales)
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-5, (step, err)
        last = torch.tensor(np.cumsum(qlens) - 1, device=kernel_device)
        next_tokens = model.compute_logits(ref[last]).argmax(-1).tolist()
        assert fused.logits(out[last]).argmax(-1).tolist() == next_tokens
        context = lens
        for s, t in zip(seqs, next_tokens, strict=True):
            s.append(t)
