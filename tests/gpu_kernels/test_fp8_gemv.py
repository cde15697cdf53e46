"""FP8 weights in the decode products (on `kernel_device`): one-row inputs of an FP8 linear layer
multiply weight-only, reading the FP8 weight and scaling each output row in the epilogue."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton_engine.model.kernels.launch_table import LAUNCH_TABLES
from baton_engine.model.kernels.triton_fp8 import (
    FP8_CUDA_GEMV,
    FP8_ROCM_GEMV,
    fp8_gemv_table_for,
    fp8_weight_gemv,
    site_of_layer,
)
from baton_engine.model.kernels.triton_gemv import SITES
from baton_engine.model.quantization import fp8 as F8
from baton_engine.model.quantization.fp8_config import Fp8Scheme
from baton_engine.model.quantization.fp8_linear import Fp8LinearMethod, arithmetic_for_rows

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _weight(rows: int, cols: int, fmt: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: a scale applied to the wrong row shows.
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows)[:, None]
    return F8.quantize_weight(w, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_product_is_the_weight_only_reference_in_float32(
    fmt: torch.dtype, kernel_device: torch.device
) -> None:
    # K not a multiple of the 1024-column loop, N not a multiple of the 8 rows of a program.
    wq, ws = _weight(45, 1500, fmt, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1500, generator=gen)
    bias = torch.randn(45, generator=gen)
    dev = kernel_device
    got = fp8_weight_gemv(x.to(dev), wq.to(dev), ws.to(dev), bias.to(dev))
    want = F8.fp8_linear_reference(x, wq, ws, "none", bias=bias)
    assert got.dtype == torch.float32 and got.shape == (1, 45)
    # Exact products of FP8 and float32 values; the sums differ only in order (and the scale is
    # applied to the sum instead of to each weight).
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_product_rounds_once_to_16_bit(dtype: torch.dtype, kernel_device: torch.device) -> None:
    fmt = F8.fp8_dtype_for_device(kernel_device)
    wq, ws = _weight(64, 512, fmt, 2)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = fp8_weight_gemv(x.to(kernel_device), wq.to(kernel_device), ws.to(kernel_device), None)
    exact = F8.fp8_linear_reference(x.float(), wq, ws, "none")
    assert got.dtype == dtype
    # One rounding of the float32 result to 16 bits: the correctly rounded value, or its
    # neighbour where the sums' order moves the float32 result across a rounding boundary.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.float().cpu(), exact.to(dtype).float(), rtol=ulp, atol=1e-6)


def test_the_linear_method_multiplies_one_row_weight_only_and_more_rows_w8a8(
    kernel_device: torch.device,
) -> None:
    """An FP8 layer of the dynamic scheme: one row is `fp8_weight_gemv`'s weight-only product, two
    rows are quantized per token (W8A8), on a GPU as on the CPU (`arithmetic_for_rows`)."""
    fmt = F8.fp8_dtype_for_device(kernel_device)
    wq, ws = _weight(48, 96, fmt, 4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 96, generator=gen)
    method = Fp8LinearMethod(Fp8Scheme("channel", "dynamic"), fmt, quantize_on_load=True, gemm="triton")
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(wq.to(kernel_device), requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(ws.to(kernel_device), requires_grad=False))
    one = method.apply(layer, x[:1].to(kernel_device), None).cpu()  # type: ignore[arg-type]
    two = method.apply(layer, x.to(kernel_device), None).cpu()  # type: ignore[arg-type]
    torch.testing.assert_close(one, F8.fp8_linear_reference(x[:1], wq, ws, "none"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two, F8.fp8_linear_reference(x, wq, ws, "dynamic"), rtol=1e-5, atol=1e-5)
    # The two arithmetics differ (the activations' own quantization error): a row's output
    # depends on how many rows the step multiplies, as documented.
    assert not torch.allclose(one, two[:1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("scheme", "rows", "arithmetic"),
    [("dynamic", 1, "none"), ("dynamic", 2, "dynamic"), ("static", 1, "none"), ("static", 8, "static"),
     ("none", 1, "none"), ("none", 300, "none")],
)  # fmt: skip
def test_arithmetic_for_rows(scheme: F8.ActivationScheme, rows: int, arithmetic: str) -> None:
    assert arithmetic_for_rows(scheme, rows) == arithmetic


def test_each_backend_takes_its_fp8_table_and_a_layer_its_call_sites_launch() -> None:
    """A layer's own one-row product (`fp8_weight_gemv`) takes the launch of its call site in the
    fused decoder, so both sum a row in the same order (the fast path's tokens are the reference
    runner's); ROCm's entries are NVIDIA's lanes as half the wavefronts, one stage."""
    assert {name: fp8_gemv_table_for(t).name for name, t in LAUNCH_TABLES.items()} == {
        "cuda": "cuda-fp8",
        "cuda-sm80": "cuda-fp8",
        "rocm": "rocm-fp8",
    }
    prefixes = [
        "model.layers.3.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.mlp.gate_up_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.shared_expert.gate_proj",
        "",
    ]
    assert [site_of_layer(p) for p in prefixes] == ["qkv", "o", "gate_up", "down", "lm_head", "lm_head"]
    for site in SITES:
        cuda, rocm = FP8_CUDA_GEMV.launch(site, 1), FP8_ROCM_GEMV.launch(site, 1)
        assert not cuda.use_dot and cuda.reason and rocm.reason
        assert (rocm.block_n, rocm.block_k, rocm.num_warps, rocm.num_stages) == (
            cuda.block_n, cuda.block_k, max(1, cuda.num_warps // 2), 1,
        )  # fmt: skip
    generic, o = FP8_CUDA_GEMV.launch("lm_head", 1), FP8_CUDA_GEMV.launch("o", 1)
    assert dataclasses.replace(generic, reason=o.reason) == o
