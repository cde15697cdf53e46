from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    # The test models are tiny and the CI machine's two cores are shared: with several intra-op
    # threads, OpenMP contention makes small float64 GEMMs ~100x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
