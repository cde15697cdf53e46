"""The fused Triton forward (on `kernel_device`) against the reference decoder, step by step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal
from unittest import mock

import numpy as np
import pytest
import torch

from baton_engine.model.attention import torch_backend
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


def test_fp8_weights_decode_products_match_reference(tmp_path: Path, kernel_device: torch.device) -> None:
    """FP8 weights (quantized on load): one sequence, so its decode steps run the decode products
    over the FP8 weights with their per-row scales, against the reference decoder's FP8 layers
    (whose one-row products are weight-only too). The prefill is the reference's alone: its
    9-row products quantize activations per token, where float32 rounding differences between
    the decoders' norms move values across FP8 rounding midpoints (2e-3 apart then)."""
    fused = _prefill_then_decode(
        "llama", torch.float32, tmp_path, kernel_device, quantization="fp8", prompt_lens=(9,),
        reference_prefill=True,
    )  # fmt: skip
    assert fused.gemv_max_tokens == 1 and fused.projection_table is not fused.gemv_table


@contextlib.contextmanager
def _reference_stores(codes: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """The reference decoder stores (and attends over) `codes` [layers, 2, tokens, KVH, D], the
    fused decoder's FP8 bytes of this step, instead of its own quantization of its K and V, so the
    two decoders read the same dequantized values and can be compared bit-close. Yields the
    reference's own codes (layer by layer, K then V) as it made them."""
    own: list[torch.Tensor] = []
    original = torch_backend.cast_saturated

    def store_fused_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        layer, part = divmod(len(own), 2)
        own.append(original(x, dtype).view(torch.uint8))
        return codes[layer, part].reshape(x.shape).view(dtype)

    with mock.patch.object(torch_backend, "cast_saturated", store_fused_codes):
        yield own
    assert len(own) == 2 * codes.shape[0]


def _assert_float32_rounding_apart(own: list[torch.Tensor], fused: torch.Tensor, step: int) -> None:
    """The reference's own FP8 codes are the fused decoder's except where its float32 K/V (from
    differently ordered sums: norms, products, rotation) falls on the other side of a rounding
    midpoint: rare, and then the neighbouring code. Codes are compared as signed steps from
    zero (E4M3 is sign-magnitude), so -0 (e4m3fn's 0x80: the same value, to which either
    decoder may round a tiny negative value) is zero's step and the smallest values of both
    signs are its neighbours."""

    def codes(stored: torch.Tensor) -> torch.Tensor:
        bits = stored.to(torch.int16)
        return (bits & 0x7F) * (1 - 2 * (bits >> 7))

    distance = (codes(torch.stack(own).view(fused.shape)) - codes(fused)).abs()
    differing = int((distance > 0).sum())
    assert int(distance.max()) <= 1 and differing <= max(1, fused.numel() // 1000), (step, differing)


def _prefill_then_decode(
    family: str,
    kv_dtype: torch.dtype,
    tmp_path: Path,
    kernel_device: torch.device,
    quantization: Literal["fp8"] | None = None,
    prompt_lens: tuple[int, ...] = (6, 11),
    reference_prefill: bool = False,
) -> FusedDecoder:
    """`reference_prefill`: the reference decoder alone runs the first step (the prefill) and the
    fused one starts from a copy of its cache."""
    parity_model(family).save(tmp_path / family)
    loaded = load_model(
        str(tmp_path / family), kernel_device, torch.float32, requested_quantization=quantization
    )
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
    tables = np.array([[3, 7, 1, 0], [2, 9, 4, 5]])[: len(prompt_lens)]
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, config.vocab_size, size=n).tolist() for n in prompt_lens]
    seqs = [list(p) for p in prompts]
    context = [0] * len(prompts)
    for step in range(3):
        lens = [len(s) for s in seqs]
        batch = _batch(lens, context, tables, kernel_device)
        ids = torch.tensor(
            [t for s, c in zip(seqs, context, strict=True) for t in s[c:]], device=kernel_device
        )
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
            workspace = DecodeWorkspace(2, config.num_heads, config.head_dim, 2, bt.device)
            meta = DecodeMeta(bt, seq_lens, workspace)
        with torch.no_grad():
            for block in moe_blocks:  # the fused decoder's experts: Triton's grouped GEMMs
                block.implementation = "triton"
            if reference_prefill and step == 0:
                out = model(ids, ref_cache, backend, batch, kv_scales)
                fast_cache.copy_(ref_cache)
            else:
                out = fused.forward(ids, batch.positions, batch.slot_mapping, fast_cache, meta, kv_scales)
            for block in moe_blocks:  # the reference experts for the reference decoder
                block.implementation = "torch"
            if kv_scales is None:
                ref = model(ids, ref_cache, backend, batch, kv_scales)
            else:
                written = fast_cache.view(torch.uint8).flatten(2, 3)[:, :, batch.slot_mapping]
                with _reference_stores(written) as own_codes:
                    ref = model(ids, ref_cache, backend, batch, kv_scales)
                _assert_float32_rounding_apart(own_codes, written, step)
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-5, (step, err)
        last = torch.tensor(np.cumsum(qlens) - 1, device=kernel_device)
        next_tokens = model.compute_logits(ref[last]).argmax(-1).tolist()
        assert fused.logits(out[last]).argmax(-1).tolist() == next_tokens
        context = lens
        for s, t in zip(seqs, next_tokens, strict=True):
            s.append(t)
    return fused
