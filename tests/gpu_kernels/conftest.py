"""Triton kernels run on the CPU through Triton's interpreter (must be set before triton loads)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    # Tiny shapes on a shared 2-core machine: intra-op threads only add contention.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
