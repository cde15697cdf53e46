"""Triton kernels on `kernel_device` (tests/conftest.py): compiled on a GPU, interpreted on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    # Tiny shapes on a shared 2-core machine: intra-op threads only add contention.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
