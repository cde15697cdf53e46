from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_support.tiny_models import SPECULATIVE
from tests.torch_threads import one_torch_thread

TINY_VOCAB = SPECULATIVE.vocab_size


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float64 Llama whose greedy outputs loop often enough for n-gram drafts to hit."""
    directory = tmp_path_factory.mktemp("spec-tiny") / "llama"
    SPECULATIVE.save(directory)
    return directory
