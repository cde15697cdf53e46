"""Fixtures of the autoscaler tests on a real API server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton_support.fake_engines import Load


@pytest.fixture
def loads() -> Iterator[dict[str, Load]]:
    """One /metrics server per role answering the load the test sets; stopped afterwards."""
    made = {"prefill": Load(), "decode": Load()}
    yield made
    for load in made.values():
        load.server.stop()
