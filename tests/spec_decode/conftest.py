from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from baton_support.tiny_models import SPECULATIVE

TINY_VOCAB = SPECULATIVE.vocab_size


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    # The CI machine's two cores are shared: several intra-op threads only add contention.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float64 Llama whose greedy outputs loop often enough for n-gram drafts to hit."""
    directory = tmp_path_factory.mktemp("spec-tiny") / "llama"
    SPECULATIVE.save(directory)
    return directory
