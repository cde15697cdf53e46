"""The decode products (`triton_gemv`, on `kernel_device`) against float64 references.

Every output is poisoned (NaN) before the launch, so an unwritten element fails. float32 runs
everywhere; bfloat16 only on a GPU (Triton's interpreter truncates float32 -> bfloat16 instead of
rounding, and its bfloat16 dot is wrong), where the error against the exact result may be a few
bfloat16 roundings (2^-9 each): 1e-2 for a product, 3e-2 after the norm/silu/rotary roundings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.model.kernels.triton_attention import DecodeWorkspace
from baton_engine.model.kernels.triton_gemv import (
    CUDA_GEMV,
    GEMV_ENGINE_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    GemvLaunch,
    gemv,
    gemv_qkv_rope,
    gemv_residual,
    gemv_silu,
    residual_programs,
    sum_squares,
)
from baton_engine.model.kernels.triton_tiles import pdl_supported
from baton_engine.model.linear import ParallelLinear, UnquantizedLinearMethod
from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.rope import apply_rotary
from baton_engine.worker.gpu.fused_decoder import DecodeMeta, FusedDecoder
from baton_support.tiny_models import parity_model

# An FMA loop (1 token: one accumulator per weight element) and a dot of a 16-row tile; K = 96
# is not a multiple of 64, N = 40 not of 16: both tails are masked.
FMA = GemvLaunch(8, 64, 4, 2, False, "test")
DOT = GemvLaunch(16, 64, 4, 2, True, "test")
K, N, INTER, EPS = 96, 40, 24, 1e-5
H, KVH, D = 4, 2, 16


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "an output element was not written"
    return float((out.double().cpu() - ref).norm() / ref.norm())


def _cases(device: torch.device) -> list[tuple[torch.dtype, GemvLaunch, int]]:
    """One token (always the FMA loop), 3 through the dot, 8 through the FMA loop (float32); on
    a GPU also bfloat16 at 1 and 5 tokens."""
    cases = [(torch.float32, FMA, 1), (torch.float32, DOT, 3), (torch.float32, FMA, GEMV_MAX_TOKENS)]
    if device.type == "cuda":
        cases += [(torch.bfloat16, FMA, 1), (torch.bfloat16, DOT, 5)]
    return cases


def _bound(dtype: torch.dtype, chain: bool = False) -> float:
    if dtype == torch.float32:
        return 2e-5 if chain else 2e-6
    return 3e-2 if chain else 1e-2


def test_plain_product_with_scale_and_bias(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype, launch, tokens in _cases(kernel_device):
        x, w, bias = _rand(gen, tokens, K), _rand(gen, N, K), _rand(gen, N)
        scale = 0.5 + torch.rand(N, generator=gen, dtype=torch.float64)
        out = torch.full((tokens, N), float("nan"), dtype=dtype, device=kernel_device)
        gemv(
            x.to(dtype).to(kernel_device),
            w.to(dtype).to(kernel_device),
            launch,
            bias=bias.to(dtype).to(kernel_device),
            w_scale=scale.float().to(kernel_device),
            out=out,
        )
        xr, wr, br = (t.to(dtype).double() for t in (x, w, bias))
        assert _rel(out, (xr @ wr.T) * scale + br) < _bound(dtype), (dtype, launch.use_dot, tokens)


def test_residual_update_and_its_sums_of_squares(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype, launch, tokens in _cases(kernel_device):
        x, w, res = _rand(gen, tokens, K), _rand(gen, N, K, scale=0.1), _rand(gen, tokens, N)
        residual = res.to(dtype).to(kernel_device)
        squares = torch.full((tokens, 8), float("nan"), device=kernel_device)
        programs = gemv_residual(
            x.to(dtype).to(kernel_device), w.to(dtype).to(kernel_device), residual, squares, launch
        )
        assert programs == residual_programs(N, launch) == -(-N // launch.block_n)
        ref = res.to(dtype).double() + x.to(dtype).double() @ w.to(dtype).double().T
        assert _rel(residual, ref) < _bound(dtype)
        # The partials sum to the squared norm of the residual as stored (after rounding).
        stored = residual.double().cpu()
        assert _rel(squares[:, :programs].sum(1), stored.pow(2).sum(1)) < 1e-6
        assert torch.isnan(squares[:, programs:]).all()  # nothing written past the programs


def _partials(
    x: torch.Tensor, device: torch.device, dtype: torch.dtype, split: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x in `dtype` on the device, and its sums of squares split over `split` partials."""
    stored = x.to(dtype)
    parts = stored.double().pow(2).view(x.shape[0], split, -1).sum(-1)
    squares = torch.full((x.shape[0], 64), float("nan"), device=device)
    squares[:, :split] = parts.float().to(device)
    return stored.to(device), squares


def test_norm_gate_up_silu(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    for dtype, launch, tokens in _cases(kernel_device):
        x, w = _rand(gen, tokens, K), _rand(gen, 2 * INTER, K, scale=0.2)
        norm = 1 + 0.1 * _rand(gen, K)
        xd, squares = _partials(x, kernel_device, dtype, split=3)
        out = torch.full((tokens, INTER), float("nan"), dtype=dtype, device=kernel_device)
        gemv_silu(
            xd,
            squares,
            3,
            norm.to(dtype).to(kernel_device),
            EPS,
            w.to(dtype).to(kernel_device),
            launch,
            out=out,
        )
        gate_up = _rms(x.to(dtype).double(), norm.to(dtype).double()) @ w.to(dtype).double().T
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        assert _rel(out, expected) < _bound(dtype, chain=True), (dtype, launch, tokens)


def test_norm_qkv_rotary_and_cache_write(kernel_device: torch.device) -> None:
    """Against the reference modules' math (RMSNorm, matmul, `apply_rotary`) in float64."""
    gen = torch.Generator().manual_seed(4)
    rows = (H + 2 * KVH) * D
    for dtype, launch, tokens in _cases(kernel_device):
        x, w, bias = _rand(gen, tokens, K), _rand(gen, rows, K, scale=0.2), _rand(gen, rows)
        norm = 1 + 0.1 * _rand(gen, K)
        angles = _rand(gen, 64, D // 2)
        cos = torch.cat([angles.cos(), angles.cos()], -1)
        sin = torch.cat([angles.sin(), angles.sin()], -1)
        positions = torch.tensor([5, 9, 30, 2, 7, 11, 40, 63][:tokens])
        slots = torch.tensor([3, -1, 7, 12, 0, 9, 15, 5][:tokens])  # -1: a padding row
        xd, squares = _partials(x, kernel_device, dtype, split=1)
        cache = torch.full((2, 4, 4, KVH, D), float("nan"), dtype=dtype, device=kernel_device)
        q = gemv_qkv_rope(
            xd, squares, 1, norm.to(dtype).to(kernel_device), EPS, w.to(dtype).to(kernel_device),
            positions.to(kernel_device), cos.to(dtype).to(kernel_device), sin.to(dtype).to(kernel_device),
            slots.to(kernel_device), cache, H, KVH, D, launch, bias=bias.to(dtype).to(kernel_device),
        )  # fmt: skip
        qkv = _rms(x.to(dtype).double(), norm.to(dtype).double()) @ w.to(dtype).double().T + bias.to(dtype)
        table_cos, table_sin = (
            cos.to(dtype).double()[positions, None],
            sin.to(dtype).double()[positions, None],
        )
        q_ref = apply_rotary(qkv[:, : H * D].view(tokens, H, D), table_cos, table_sin).reshape(tokens, -1)
        k_ref = apply_rotary(qkv[:, H * D : (H + KVH) * D].view(tokens, KVH, D), table_cos, table_sin)
        ref_cache = torch.full((2, 4, 4, KVH, D), float("nan"), dtype=torch.float64)
        real = slots >= 0
        ref_cache[0].view(-1, KVH, D)[slots[real]] = k_ref[real]
        ref_cache[1].view(-1, KVH, D)[slots[real]] = qkv[:, (H + KVH) * D :].view(tokens, KVH, D)[real]
        assert _rel(q, q_ref) < _bound(dtype, chain=True), (dtype, launch, tokens)
        written = ~torch.isnan(ref_cache)
        assert torch.equal(~torch.isnan(cache.cpu()), written)  # exactly the real rows' slots
        assert _rel(cache.cpu()[written], ref_cache[written]) < _bound(dtype, chain=True)


def test_sum_squares_seeds_the_first_norm(kernel_device: torch.device) -> None:
    x = torch.arange(1.0, 2 * 2000 + 1).view(2, 2000).to(kernel_device)
    out = torch.full((2, 3), float("nan"), device=kernel_device)
    assert sum_squares(x, out) == 1
    assert out[:, 0].cpu().double().tolist() == pytest.approx(
        x.cpu().double().pow(2).sum(1).tolist(), rel=1e-6
    )
    assert torch.isnan(out[:, 1:]).all()


def test_bad_shapes_are_refused(kernel_device: torch.device) -> None:
    x = torch.zeros(GEMV_MAX_TOKENS + 1, K, device=kernel_device)
    with pytest.raises(ValueError, match="1..8 token rows, got 9"):
        gemv(x, torch.zeros(N, K, device=kernel_device), FMA)
    with pytest.raises(ValueError, match="must share K"):
        gemv(x[:2], torch.zeros(N, K + 1, device=kernel_device), FMA)


def test_table_covers_every_site_and_bucket() -> None:
    assert CUDA_GEMV.launch("qkv", 1).use_dot is False
    assert CUDA_GEMV.launch("down", 3) == CUDA_GEMV.entries[("down", 4)]
    assert CUDA_GEMV.launch("lm_head", 8) == CUDA_GEMV.entries[("lm_head", 8)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoder_few_token_path_matches_the_matmul_path(
    family: str, tmp_path: Path, kernel_device: torch.device
) -> None:
    """One decode step of 3 rows through the decode products and through torch's matmul: the
    same hidden states, the same K/V written, the same greedy tokens."""
    parity_model(family).save(tmp_path / family)
    loaded = load_model(str(tmp_path / family), kernel_device, torch.float32)
    config = loaded.config
    fast = FusedDecoder(loaded.model, gemv_max_tokens=GEMV_MAX_TOKENS)
    plain = FusedDecoder(loaded.model, decode_gemv=False)
    assert (fast.gemv_max_tokens, plain.gemv_max_tokens) == (GEMV_MAX_TOKENS, 0)
    assert FusedDecoder(loaded.model).gemv_max_tokens == GEMV_ENGINE_MAX_TOKENS == 1
    gen = np.random.default_rng(5)
    caches = []
    outs = []
    lens = torch.tensor([9, 3, 14], dtype=torch.int32, device=kernel_device)
    tables = torch.tensor(
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32, device=kernel_device
    )
    shape = (config.num_layers, 2, 12, 4, config.num_kv_heads, config.head_dim)
    start = torch.from_numpy(gen.standard_normal(shape).astype(np.float32)).to(kernel_device)
    ids = torch.from_numpy(gen.integers(0, config.vocab_size, size=3)).to(kernel_device)
    positions = (lens - 1).long()
    slots = tables.long().gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    for decoder in (fast, plain):
        cache = start.clone()
        meta = DecodeMeta(
            tables, lens, DecodeWorkspace(3, config.num_heads, config.head_dim, 2, kernel_device)
        )
        with torch.no_grad():
            outs.append(decoder.forward(ids, positions, slots, cache, meta))
        caches.append(cache)
    assert _rel(outs[0], outs[1].double().cpu()) < 1e-5
    assert _rel(caches[0], caches[1].double().cpu()) < 1e-5
    with torch.no_grad():
        assert fast.logits(outs[0]).argmax(-1).tolist() == plain.logits(outs[1]).argmax(-1).tolist()


def test_programmatic_dependent_launch_changes_no_bit(tmp_path: Path, kernel_device: torch.device) -> None:
    """A one-row decode step (products, split-K attention merged in its kernel, LM head) captured
    in a graph with and without programmatic dependent launch: the kernels differ only in when
    they launch, so hidden states, logits and the K/V written are equal bit for bit, replay after
    replay, and every split counter is back at zero. PDL is on by default exactly where supported."""
    parity_model("llama").save(tmp_path / "llama")
    loaded = load_model(str(tmp_path / "llama"), kernel_device, torch.float32)
    config = loaded.config
    assert FusedDecoder(loaded.model).pdl is pdl_supported(kernel_device)
    if not pdl_supported(kernel_device):
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0+")
    gen = np.random.default_rng(7)
    shape = (config.num_layers, 2, 64, 4, config.num_kv_heads, config.head_dim)
    start = torch.from_numpy(gen.standard_normal(shape).astype(np.float32)).to(kernel_device)
    tables = torch.arange(50, dtype=torch.int32, device=kernel_device)[None, :]
    lens = torch.tensor([200], dtype=torch.int32, device=kernel_device)  # 4 splits of 64 keys
    ids = torch.from_numpy(gen.integers(0, config.vocab_size, size=1)).to(kernel_device)
    positions = (lens - 1).long()
    slots = positions.clone()  # the table is the identity: position p lives in slot p
    results = []
    for pdl in (False, True):
        decoder = FusedDecoder(loaded.model, pdl=pdl)
        workspace = DecodeWorkspace(1, config.num_heads, config.head_dim, 4, kernel_device)
        meta = DecodeMeta(tables, lens, workspace)
        cache = start.clone()
        with torch.no_grad():
            decoder.logits(decoder.forward(ids, positions, slots, cache, meta))  # compile outside
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                hidden = decoder.forward(ids, positions, slots, cache, meta)
                logits = decoder.logits(hidden)
        replays = []
        for _ in range(2):
            cache.copy_(start)
            graph.replay()
            replays.append((hidden.clone(), logits.clone(), cache.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*replays, strict=True))
        assert int(workspace.arrivals.count_nonzero()) == 0
        results.append(replays[0])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_models_with_qk_norm_keep_the_matmul_path(tmp_path: Path, kernel_device: torch.device) -> None:
    parity_model("qwen3").save(tmp_path / "qwen3")
    loaded = load_model(str(tmp_path / "qwen3"), kernel_device, torch.float32)
    assert FusedDecoder(loaded.model).gemv_max_tokens == 0


def test_models_with_a_quantized_projection_keep_the_matmul_path(
    tmp_path: Path, kernel_device: torch.device
) -> None:
    """The decode products read a projection's `weight` as [out, in] in the model dtype: a
    projection applied through another quantization method (FP8, packed weights) keeps its
    own `apply`, so the whole step stays on the matmul path."""

    class ScaledMethod(UnquantizedLinearMethod):
        """Another method over the same weight: the product it applies is not F.linear's."""

        def apply(self, layer: ParallelLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return 2.0 * super().apply(layer, x, bias)

    parity_model("llama").save(tmp_path / "llama")
    loaded = load_model(str(tmp_path / "llama"), kernel_device, torch.float32)
    assert FusedDecoder(loaded.model).gemv_max_tokens == 1
    loaded.model.model.decoder_layers()[1].mlp.down_proj.quant_method = ScaledMethod()
    assert FusedDecoder(loaded.model).gemv_max_tokens == 0
