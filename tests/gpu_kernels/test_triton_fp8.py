"""The FP8 Triton kernels (on `kernel_device`) against the torch reference numerics."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.kernels.triton_fp8 import GemmTiles, fp8_gemm, quantize_rows
from baton_engine.model.quantization import fp8 as F8

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_dynamic_row_quantization_is_bit_exact(fp8_dtype: torch.dtype, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows from 1e-8 to 1e3 in magnitude (subnormal grid included), one row all zeros, K not a
    # power of two and wider than one block.
    x = torch.randn(33, 1500, generator=gen) * torch.logspace(-8, 3, 33)[:, None]
    x[7] = 0.0
    q, scale = quantize_rows(x.to(kernel_device), fp8_dtype, block_k=512)
    want_q, want_scale = F8.quantize_per_token(x, fp8_dtype)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(_bits(q), _bits(want_q))
    assert float(scale[7]) == float(torch.tensor(F8.MIN_SCALE) / F8.fp8_max(fp8_dtype))
    assert torch.equal(_bits(q[7]), torch.zeros(1500, dtype=torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_static_row_quantization_saturates(fp8_dtype: torch.dtype, kernel_device: torch.device) -> None:
    limit = F8.fp8_max(fp8_dtype)
    x = torch.tensor([[0.0, 1.0, -1.0, 3.3, limit * 0.5, limit * 10.0, -limit * 10.0, 1e-30]])
    scale = torch.tensor(0.5)
    q, scales = quantize_rows(x.to(kernel_device), fp8_dtype, scale.to(kernel_device))
    assert scales.cpu().tolist() == [0.5]
    assert torch.equal(_bits(q), _bits(F8.quantize_static(x, scale, fp8_dtype)))
    values = q.float().cpu()[0].tolist()
    assert values[:3] == [0.0, 2.0, -2.0]
    assert values[5:7] == [limit, -limit]  # saturated, not NaN


@pytest.mark.parametrize(
    ("rows", "tiles"),
    [(1, None), (5, None), (40, None), (130, GemmTiles(32, 32, 32, 2, 4, 2))],
    ids=["decode-1", "decode-5", "mid-40", "prefill-130"],
)
def test_w8a8_gemm_matches_reference(rows: int, tiles: GemmTiles | None, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen)
    w = torch.randn(72, 200, generator=gen) * 0.1
    bias = torch.randn(72, generator=gen)
    wq, ws = F8.quantize_weight(w, torch.float8_e4m3fn)
    want = F8.fp8_linear_reference(x, wq, ws, "dynamic", bias=bias)
    # The sum of the products' magnitudes: what a reduced-precision adder's error scales with.
    a = F8.dequantize(*F8.quantize_per_token(x, torch.float8_e4m3fn))
    magnitude = a.abs() @ F8.dequantize(wq, ws).abs().T
    for native in (False, True):
        q, scale = quantize_rows(x.to(kernel_device), torch.float8_e4m3fn)
        got = fp8_gemm(
            q, scale, wq.to(kernel_device), ws.to(kernel_device), bias.to(kernel_device),
            torch.float32, native, tiles,
        )  # fmt: skip
        assert got.shape == (rows, 72)
        if native and kernel_device.type == "cuda":
            # FP8 tensor cores add each instruction's products (k = 32 on sm_90) in a reduced-
            # precision adder before the float32 accumulator takes them (max_num_imprecise_acc=0):
            # within 2**-10 of the products' magnitudes, not bit-close. Widened to float16 (not
            # native), the products and sums are float32's and the result is.
            error = (got.cpu() - want).abs()
            assert bool((error <= magnitude * 2**-10 + 1e-5).all()), float((error / magnitude).max())
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_only_gemm_widens_fp8_weights_to_the_activations_dtype(
    dtype: torch.dtype, kernel_device: torch.device
) -> None:
    if dtype == torch.bfloat16 and kernel_device.type == "cpu":
        pytest.skip("Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot); checked on the GPU")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    w = torch.randn(48, 96, generator=gen)
    wq, ws = F8.quantize_weight(w, torch.float8_e4m3fn, per_channel=False)
    got = fp8_gemm(
        x.to(kernel_device), None, wq.to(kernel_device), ws.expand(48).contiguous().to(kernel_device),
        None, dtype, False,
    )  # fmt: skip
    want = F8.fp8_linear_reference(x, wq, ws, "none")
    assert got.dtype == dtype
    # 16-bit output: within one rounding of the float32 result.
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=8e-3, atol=1e-2)


def test_gemm_of_no_rows_launches_nothing(kernel_device: torch.device) -> None:
    w = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=kernel_device)
    out = fp8_gemm(
        torch.zeros(0, 32, device=kernel_device), None, w, torch.ones(16, device=kernel_device),
        None, torch.float32, False,
    )  # fmt: skip
    assert out.shape == (0, 16)
