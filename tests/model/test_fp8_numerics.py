"""FP8 numerics: formats per device, scales, round trips, fnuz conversion, the reference GEMM."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.quantization import fp8 as F8


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        ("gfx942", torch.float8_e4m3fnuz),  # MI300X / MI325X
        ("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),
        ("gfx940", torch.float8_e4m3fnuz),
        ("gfx950", torch.float8_e4m3fn),  # MI350X / MI355X: OCP
        ("gfx90a", torch.float8_e4m3fn),  # MI250X: no FP8 units; the reference path reads fn
        ("sm_90", torch.float8_e4m3fn),
        ("cpu", torch.float8_e4m3fn),
    ],
)
def test_format_per_architecture(arch: str, dtype: torch.dtype) -> None:
    assert F8.fp8_dtype_for_arch(arch) == dtype


def test_format_limits() -> None:
    assert F8.fp8_max(torch.float8_e4m3fn) == 448.0
    assert F8.fp8_max(torch.float8_e4m3fnuz) == 240.0
    with pytest.raises(ValueError, match="torch.bfloat16 is not an FP8 format"):
        F8.fp8_max(torch.bfloat16)


def test_per_channel_weight_quantization_uses_each_rows_max() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    q, scale = F8.quantize_weight(w, torch.float8_e4m3fn)
    assert scale.tolist() == pytest.approx([2.0 / 448.0, 1.0, 1e-12 / 448.0])
    assert q.float()[1].tolist() == [448.0, 0.0, 1.0]
    assert q.float()[0].tolist() == [224.0, -448.0, 112.0]
    assert torch.equal(
        F8.dequantize(q, scale), torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, 1.0], [0, 0, 0.0]])
    )
    q, scale = F8.quantize_weight(w, torch.float8_e4m3fn, per_channel=False)
    assert scale.shape == () and float(scale) == 1.0


def test_round_trip_error_is_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    for dtype, min_exp in ((torch.float8_e4m3fn, -6), (torch.float8_e4m3fnuz, -7)):
        q, scale = F8.quantize_per_token(x, dtype)
        assert scale.shape == (64,)
        scaled = x / scale[:, None]  # what was rounded onto the format's grid
        err = (q.float() - scaled).abs()
        # 3 mantissa bits: the grid step at exponent e is 2**(e - 3), subnormals share the
        # smallest normal's step; rounding to nearest errs by at most half a step.
        exponent = torch.floor(torch.log2(scaled.abs().clamp(min=2.0**min_exp)))
        assert bool((err <= 2.0 ** (exponent - 3) / 2).all())


def test_saturation_instead_of_nan() -> None:
    x = torch.tensor([1e9, -1e9, 300.0])
    q = F8.quantize_static(x, torch.tensor(1.0), torch.float8_e4m3fnuz)
    assert q.float().tolist() == [240.0, -240.0, 240.0]


def test_fnuz_conversion_keeps_every_value() -> None:
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(every_byte.float())
    scale = torch.tensor(0.75)
    fnuz, fnuz_scale = F8.to_fnuz(every_byte, scale)
    assert float(fnuz_scale) == 1.5
    assert torch.equal(F8.dequantize(fnuz, fnuz_scale)[finite], F8.dequantize(every_byte, scale)[finite])
    negative_zero = torch.tensor([0x80], dtype=torch.uint8).view(torch.float8_e4m3fn)
    converted, _ = F8.to_fnuz(negative_zero, scale)
    assert converted.view(torch.uint8).tolist() == [0]  # 0x80 is NaN in fnuz


def test_merged_layer_scales_become_one_per_channel_vector() -> None:
    q, k, v = torch.tensor(0.5), torch.tensor([0.25]), torch.tensor([[1.0], [2.0]])
    scales = F8.channel_scales([q, k, v], [3, 1, 2])
    assert scales.tolist() == [0.5, 0.5, 0.5, 0.25, 1.0, 2.0]
    with pytest.raises(ValueError, match="weight_scale: 2 values for a weight of 3 rows"):
        F8.channel_scales([torch.ones(2)], [3])


@pytest.mark.parametrize("scheme", ["dynamic", "static", "none"])
def test_reference_linear_is_the_dequantized_product(scheme: F8.ActivationScheme) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=gen)
    w = torch.randn(16, 32, generator=gen)
    wq, ws = F8.quantize_weight(w, torch.float8_e4m3fn)
    input_scale = torch.tensor(x.abs().max().item() / 448.0)
    got = F8.fp8_linear_reference(x, wq, ws, scheme, input_scale)
    if scheme == "dynamic":
        a = F8.dequantize(*F8.quantize_per_token(x, torch.float8_e4m3fn))
    elif scheme == "static":
        a = F8.dequantize(F8.quantize_static(x, input_scale, torch.float8_e4m3fn), input_scale)
    else:
        a = x
    torch.testing.assert_close(got, a @ F8.dequantize(wq, ws).T, rtol=1e-6, atol=1e-6)
    # close to the 16-bit product: FP8 costs a few percent
    exact = x @ w.T
    assert float((got - exact).norm() / exact.norm()) < 0.06


def test_static_scheme_without_a_scale_is_refused() -> None:
    x = torch.ones(1, 4)
    wq, ws = F8.quantize_weight(torch.ones(2, 4), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="static activation quantization needs an input_scale"):
        F8.fp8_linear_reference(x, wq, ws, "static")
