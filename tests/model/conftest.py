from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.torch_threads import one_torch_thread


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield
