"""P/D with an FP8 KV cache: real engine cores pass FP8 blocks over ZMQ on 127.0.0.1 (half the
bytes of a bfloat16 cache) and give the greedy tokens of one FP8 engine; a consumer whose cache
dtype differs refuses the producer's blocks before connecting and recomputes the prompt itself.

A tiny random model in bfloat16 on the CPU keeps the five cores cheap.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.engine_factory import build_engine_core
from baton_engine.kv_transfer.connector import KVTransferConnector
from baton_support.tiny_models import TinyModel
from baton_support.wait import wait_for
from tests.pd_setup import free_port, pd_environment
from tests.torch_threads import one_torch_thread

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _settings(model: Path, role: str, kv_cache_dtype: str) -> EngineConfig:
    extra: dict[str, Any] = {} if role == "none" else {"kv_role": role}
    if role == "producer":
        extra["kv_transfer_port"] = free_port()
    return EngineConfig(
        model=str(model), dtype="bfloat16", block_size=BLOCK, num_kv_blocks=64, max_model_len=256,
        kv_cache_dtype=kv_cache_dtype, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineCore]]:
    model = tmp_path_factory.mktemp("tiny-fp8-pd")
    TinyModel(num_layers=2, dtype="float32", seed=2).save(model)
    built: dict[str, EngineCore] = {}
    with one_torch_thread(), pd_environment():
        try:
            for name, role, kv in [
                ("single_fp8", "none", "fp8"),
                ("producer_fp8", "producer", "fp8"),
                ("consumer_fp8", "consumer", "fp8"),
                ("producer_bf16", "producer", "auto"),
                ("consumer_bf16", "consumer", "auto"),
            ]:
                built[name], _ = build_engine_core(_settings(model, role, kv))
            yield built
        finally:
            for core in built.values():
                if core.kv_connector is not None:
                    core.kv_connector.close()


def _connector(core: EngineCore) -> KVTransferConnector:
    assert core.kv_connector is not None
    return core.kv_connector


def _run(
    core: EngineCore, request_id: str, prompt: list[int], kv: dict[str, Any] | None = None
) -> tuple[list[int], dict[str, Any] | None]:
    core.add_request(request_id, prompt, GREEDY, kv_transfer_params=kv)
    tokens: list[int] = []

    def finished() -> dict[str, Any] | None | bool:
        for out in core.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return out.kv_transfer_params or True
        return None

    result = wait_for(finished, interval=0, message=f"request {request_id} to finish")
    return tokens, (result if isinstance(result, dict) else None)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(length)]


def _disaggregated(
    cores: dict[str, EngineCore], producer: str, consumer: str, name: str, prompt: list[int]
) -> list[int]:
    first, kv = _run(cores[producer], f"{name}-p", prompt, {"do_remote_decode": True})
    assert kv is not None and kv["first_token"] == first[0]
    tokens, _ = _run(cores[consumer], f"{name}-d", prompt, kv)
    return tokens


def test_fp8_blocks_travel_at_half_the_bytes_of_bfloat16(cores: dict[str, EngineCore]) -> None:
    fp8_spec = _connector(cores["consumer_fp8"]).spec
    bf16_spec = _connector(cores["consumer_bf16"]).spec
    assert fp8_spec.dtype == "float8_e4m3fn" and bf16_spec.dtype == "bfloat16"
    assert 2 * fp8_spec.block_bytes == bf16_spec.block_bytes == 2 * 2 * BLOCK * 2 * 16 * 2
    for i, length in enumerate((5, 23, 41)):
        prompt = _prompt(i, length)
        want, _ = _run(cores["single_fp8"], f"s{i}", prompt)
        stats = {name: _connector(cores[name]).stats for name in ("consumer_fp8", "consumer_bf16")}
        for s in stats.values():
            s.take()
        assert _disaggregated(cores, "producer_fp8", "consumer_fp8", f"fp8-{i}", prompt) == want
        _disaggregated(cores, "producer_bf16", "consumer_bf16", f"bf16-{i}", prompt)
        fp8_bytes = stats["consumer_fp8"].take()
        bf16_bytes = stats["consumer_bf16"].take()
        blocks = -(-length // BLOCK)
        assert fp8_bytes.failures == {} and bf16_bytes.failures == {}
        assert fp8_bytes.bytes_received == blocks * fp8_spec.block_bytes
        assert 2 * fp8_bytes.bytes_received == bf16_bytes.bytes_received


def test_cache_dtype_mismatch_is_refused_and_recomputed(cores: dict[str, EngineCore]) -> None:
    prompt = _prompt(9, 30)
    alone, _ = _run(cores["consumer_bf16"], "alone", prompt)  # what the consumer computes itself
    stats = _connector(cores["consumer_bf16"]).stats
    stats.take()
    got = _disaggregated(cores, "producer_fp8", "consumer_bf16", "mismatch", prompt)
    assert got == alone
    delta = stats.take()
    assert delta.failures == {"spec_mismatch": 1} and delta.bytes_received == 0
    # the other way round too
    stats = _connector(cores["consumer_fp8"]).stats
    stats.take()
    alone, _ = _run(cores["consumer_fp8"], "alone-fp8", prompt)
    assert _disaggregated(cores, "producer_bf16", "consumer_fp8", "mismatch-2", prompt) == alone
    assert stats.take().failures == {"spec_mismatch": 1}
