from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from baton_engine.kv_transfer.producer import KVTransferProducer


@pytest.fixture
def make_producer() -> Iterator[Callable[..., KVTransferProducer]]:
    """KVTransferProducer on a free loopback port, closed at teardown."""
    made: list[KVTransferProducer] = []

    def make(kv: torch.Tensor, engine_id: str = "producer-1", **kwargs: object) -> KVTransferProducer:
        producer = KVTransferProducer(kv, engine_id=engine_id, port=0, **kwargs)  # type: ignore[arg-type]
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close()
