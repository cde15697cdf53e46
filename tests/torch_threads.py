"""One intra-op torch thread while a test runs: the test models are tiny and CI's two cores are
shared, so more threads only add OpenMP contention (small float64 GEMMs ran ~100x slower)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
