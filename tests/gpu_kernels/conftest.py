"""Triton kernels on `kernel_device` (tests/conftest.py): compiled on a GPU, interpreted on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from baton_engine.model.quantization.fp8 import FP8_DTYPES, fp8_dtype_for_device
from tests.torch_threads import one_torch_thread


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _fp8_format_on_this_device(request: pytest.FixtureRequest) -> None:
    """A test parametrized over FP8 formats runs every format under the interpreter (it emulates
    both) but only the device's own on a GPU: Triton compiles float8_e4m3fnuz for CDNA3 alone and
    float8_e4m3fn for the others."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None:
        return
    formats = [v for v in callspec.params.values() if isinstance(v, torch.dtype) and v in FP8_DTYPES]
    if not formats or "kernel_device" not in request.fixturenames:
        return
    device: torch.device = request.getfixturevalue("kernel_device")
    if device.type == "cuda" and formats[0] != fp8_dtype_for_device(device):
        pytest.skip(f"{formats[0]} is not the FP8 format this GPU's Triton compiles")
