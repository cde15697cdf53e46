"""P/D at the engine-core level: a producer core and a consumer core (SmolLM2, CPU, float32) pass
real KV over ZMQ on 127.0.0.1 and must give exactly the greedy tokens of one plain core.

The test drives both legs itself (the router is not involved): it runs the producer leg with
``{"do_remote_decode": true}``, hands the signed params it returned to the consumer leg, and
steps both cores. Faults: producer gone between the legs (recompute), consumer never pulls
(lease expiry frees), client gone during either leg (both sides freed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import RequestOutput
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.engine_factory import build_engine_core
from baton_engine.kv_transfer.connector import KVTransferConnector
from baton_support.wait import wait_for
from tests.kv_transfer.helpers import KEY
from tests.pd_setup import (
    BLOCK_SIZE,
    PREFIXED,
    SHARED_PREFIX,
    TEXTS,
    core_settings,
    free_port,
    pd_environment,
)
from tests.torch_threads import one_torch_thread

pytestmark = [pytest.mark.slow, pytest.mark.model]

BLOCK = BLOCK_SIZE
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@dataclass
class Cores:
    single: EngineCore
    producer: EngineCore
    consumer: EngineCore
    tokenizer: Any

    @property
    def prod_connector(self) -> KVTransferConnector:
        assert isinstance(self.producer.kv_connector, KVTransferConnector)
        return self.producer.kv_connector

    @property
    def cons_connector(self) -> KVTransferConnector:
        assert isinstance(self.consumer.kv_connector, KVTransferConnector)
        return self.consumer.kv_connector


@pytest.fixture(scope="module")
def cores() -> Iterator[Cores]:
    with one_torch_thread(), pd_environment(KEY.decode()):
        single, _ = build_engine_core(EngineConfig(**core_settings("none", num_kv_blocks=160)))
        producer, _ = build_engine_core(EngineConfig(**core_settings("producer", num_kv_blocks=160)))
        consumer, _ = build_engine_core(EngineConfig(**core_settings("consumer", num_kv_blocks=160)))
        try:
            yield Cores(single, producer, consumer, single.runner.loaded.tokenizer)  # type: ignore[attr-defined]
        finally:
            for core in (producer, consumer):
                assert core.kv_connector is not None
                core.kv_connector.close()


def _run(
    core: EngineCore,
    request_id: str,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    kv: dict[str, Any] | None = None,
    timeout: float = 120.0,
) -> tuple[list[int], dict[str, Any] | None, str | None, int]:
    """Run one request to its end: (tokens, kv_transfer_params, finish reason, cached tokens)."""
    core.add_request(request_id, prompt, params, kv_transfer_params=kv)
    tokens: list[int] = []

    def step_until_finished() -> RequestOutput | None:
        for out in core.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return out
        return None

    last = wait_for(
        step_until_finished, timeout=timeout, interval=0, message=f"request {request_id} to finish"
    )
    return tokens, last.kv_transfer_params, last.finish_reason, last.num_cached_tokens


def _wait_leases_freed(producer: EngineCore) -> None:
    """Until every lease of `producer` ended and its blocks were freed (an idle core frees them in
    `poll_kv_transfer`)."""

    def freed() -> bool:
        producer.poll_kv_transfer()
        return producer.scheduler.num_held_transfers == 0

    wait_for(freed, message="the producer's leases to end and their blocks to be freed")


def _used(core: EngineCore) -> int:
    return int(core.scheduler.kv_cache_manager.num_used_blocks)


def _disaggregated(cores: Cores, name: str, prompt: list[int]) -> tuple[list[int], int]:
    first, kv, reason, _ = _run(cores.producer, f"{name}-p", prompt, kv={"do_remote_decode": True})
    assert kv is not None and len(first) == 1 and reason in ("length", "stop")
    assert kv["first_token"] == first[0] and kv["num_tokens"] == len(prompt)
    producer = cores.prod_connector.producer
    assert producer is not None and producer.leases.block_ids(kv["transfer_id"]) == kv["block_ids"]
    tokens, _, _, cached = _run(cores.consumer, f"{name}-d", prompt, kv=kv)
    return tokens, cached


def test_pd_gives_the_single_engine_greedy_tokens(cores: Cores) -> None:
    prompts = [cores.tokenizer.encode(t) for t in TEXTS]
    assert len(prompts) >= 16
    baseline_prod, baseline_cons = _used(cores.producer), _used(cores.consumer)
    for i, prompt in enumerate(prompts):
        want, _, _, _ = _run(cores.single, f"s{i}", prompt)
        got, _ = _disaggregated(cores, f"pd{i}", prompt)
        assert got == want, f"prompt {i} ({len(prompt)} tokens)"
    _wait_leases_freed(cores.producer)  # DONE -> the producer frees on its next step
    assert (_used(cores.producer), _used(cores.consumer)) == (baseline_prod, baseline_cons)
    delta = cores.prod_connector.stats.take()
    assert delta.failures == {} and delta.bytes_sent > 0


def test_consumer_prefix_hit_pulls_only_the_rest(cores: Cores) -> None:
    stats = cores.cons_connector.stats
    block_bytes = cores.cons_connector.spec.block_bytes
    warm = cores.tokenizer.encode(SHARED_PREFIX + "Question: warm the cache.")
    _run(cores.consumer, "warm", warm)  # the consumer now caches SHARED_PREFIX's full blocks
    for i, suffix in enumerate(PREFIXED):
        prompt = cores.tokenizer.encode(SHARED_PREFIX + suffix)
        want, _, _, _ = _run(cores.single, f"sp{i}", prompt)
        stats.take()
        got, cached = _disaggregated(cores, f"pp{i}", prompt)
        assert got == want
        assert cached >= 2 * BLOCK  # a real partial pull
        pulled = stats.take().bytes_received
        assert pulled == (-(-len(prompt) // BLOCK) - cached // BLOCK) * block_bytes


def test_producer_gone_between_the_legs_recomputes(cores: Cores, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = cores.tokenizer.encode("The largest planet in the solar system is")
    want, _, _, _ = _run(cores.single, "gone-s", prompt)
    _, kv, _, _ = _run(cores.producer, "gone-p", prompt, kv={"do_remote_decode": True})
    assert kv is not None
    dead_port = free_port()  # nothing listens there: the producer is gone
    from baton_engine.contract import KVTransferParams

    moved = KVTransferParams.from_dict({**kv, "port": dead_port, "signature": ""}).signed(KEY).to_dict()
    cores.cons_connector.stats.take()
    got, _, reason, _ = _run(cores.consumer, "gone-d", prompt, kv=moved)
    assert got == want and reason in ("length", "stop")
    assert cores.cons_connector.stats.take().failures == {"producer_unreachable": 1}
    assert cores.prod_connector.producer is not None
    assert cores.prod_connector.producer.release(kv["transfer_id"]) is True  # clean up this lease
    cores.producer.poll_kv_transfer()


def test_fail_policy_reports_a_clear_error(cores: Cores) -> None:
    prompt = cores.tokenizer.encode("Fail policy check")
    raw = {
        "engine_id": "nobody",
        "host": "127.0.0.1",
        "port": free_port(),
        "transfer_id": "x",
        "block_ids": [0],
        "num_tokens": len(prompt),
        "first_token": 1,
        "block_size": BLOCK,
        "dtype": "float32",
    }
    from baton_engine.contract import sign_dict

    connector = cores.cons_connector
    connector.recompute_on_failure = False
    try:
        baseline = _used(cores.consumer)
        cores.consumer.add_request("fail-d", prompt, GREEDY, kv_transfer_params=sign_dict(raw, KEY))
        finished = wait_for(
            lambda: next((o for o in cores.consumer.step() if o.finished), None),
            interval=0,
            message="the failed pull to finish the request",
        )
        assert finished.finish_reason == "abort"
        assert finished.finish_message is not None
        assert finished.finish_message.startswith(
            "KV transfer from the prefill engine failed: producer_unreachable"
        )
        assert _used(cores.consumer) == baseline
    finally:
        connector.recompute_on_failure = True


def test_unpulled_lease_expires_and_frees(cores: Cores) -> None:
    baseline = _used(cores.producer)
    connector = cores.prod_connector
    connector.stats.take()  # now: the lease may expire as soon as the request finishes
    connector.lease_seconds = 0.3
    try:
        _, kv, _, _ = _run(
            cores.producer,
            "expire-p",
            cores.tokenizer.encode("Nobody pulls this one"),
            kv={"do_remote_decode": True},
        )
    finally:
        connector.lease_seconds = 30
    assert kv is not None and cores.producer.scheduler.num_held_transfers == 1
    assert _used(cores.producer) > baseline
    _wait_leases_freed(cores.producer)
    assert _used(cores.producer) == baseline
    assert connector.stats.take().leases_expired == 1


def test_client_gone_during_either_leg_frees_both_sides(cores: Cores) -> None:
    prompt = cores.tokenizer.encode("A long story about a dragon. " * 20)
    base_prod, base_cons = _used(cores.producer), _used(cores.consumer)
    # Producer leg: aborted during its prefill -> no lease, blocks freed.
    cores.producer.add_request("abort-p", prompt, GREEDY, kv_transfer_params={"do_remote_decode": True})
    cores.producer.abort_requests(["abort-p"], "client disconnected")
    outs = cores.producer.step()
    assert [(o.request_id, o.finish_reason, o.kv_transfer_params) for o in outs] == [
        ("abort-p", "abort", None)
    ]
    assert cores.producer.scheduler.num_held_transfers == 0 and _used(cores.producer) == base_prod
    # Decode leg: aborted while its pull is queued or running -> the consumer frees its blocks
    # once the pull thread let go of them, and the producer's lease ends (RELEASE or DONE).
    _, kv, _, _ = _run(cores.producer, "abort-p2", prompt, kv={"do_remote_decode": True})
    assert kv is not None
    cores.consumer.add_request("abort-d", prompt, GREEDY, kv_transfer_params=kv)
    cores.consumer.step()  # blocks reserved, pull submitted
    assert cores.cons_connector.busy()
    cores.consumer.abort_requests(["abort-d"], "client disconnected")
    finished = wait_for(
        lambda: next((o for o in cores.consumer.step() if o.request_id == "abort-d" and o.finished), None),
        interval=0,
        message="the aborted decode leg to finish",
    )
    assert finished.finish_reason == "abort"
    assert _used(cores.consumer) == base_cons
    _wait_leases_freed(cores.producer)
    assert _used(cores.producer) == base_prod


def test_abort_after_the_producer_leg_finished_releases_its_lease(cores: Cores) -> None:
    """The client went away while the prefill step ran (the server's abort reaches the core after
    the step finished the request) or before the response with the params was delivered."""
    prompt = cores.tokenizer.encode("A short story about a lighthouse keeper. " * 6)
    base_prod = _used(cores.producer)
    leased = -(-len(prompt) // BLOCK)
    _, kv, _, _ = _run(cores.producer, "late-abort-p", prompt, kv={"do_remote_decode": True})
    assert kv is not None and cores.producer.scheduler.num_held_transfers == 1
    assert _used(cores.producer) == base_prod + leased
    cores.prod_connector.stats.take()
    cores.producer.abort_requests(["late-abort-p"], "client disconnected")
    cores.producer.poll_kv_transfer()  # an idle core frees ended leases here
    assert cores.producer.scheduler.num_held_transfers == 0
    assert _used(cores.producer) == base_prod
    assert cores.prod_connector.stats.take().leases_expired == 0  # released, not expired
    cores.producer.abort_requests(["late-abort-p"], "again")  # nothing left to release: a no-op
    assert _used(cores.producer) == base_prod


def test_bad_params_are_refused_at_add(cores: Cores) -> None:
    prompt = cores.tokenizer.encode("Refused")
    with pytest.raises(ValueError, match="kv_transfer_params.do_remote_decode: unknown field"):
        cores.consumer.add_request("bad1", prompt, GREEDY, kv_transfer_params={"do_remote_decode": False})
    with pytest.raises(ValueError, match="kv_role is 'consumer', not producer"):
        cores.consumer.add_request("bad2", prompt, GREEDY, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="does no KV transfer"):
        cores.single.add_request("bad3", prompt, GREEDY, kv_transfer_params={"do_remote_decode": True})
    assert cores.consumer.num_requests == 0
