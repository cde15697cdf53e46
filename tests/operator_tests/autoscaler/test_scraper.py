"""Scraping many pods' /metrics against real HTTP servers on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from baton_engine import contract
from baton_operator.autoscaler.metrics import ScrapeTarget, scrape_pods
from baton_operator.autoscaler.policy_types import EngineLoad
from baton_support.metrics_servers import Behaviour, MetricsServer, answer, hang, held, trickle
from baton_support.ports import free_port

from .exposition import engine_exposition

StartServer = Callable[[Behaviour], MetricsServer]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    started: list[MetricsServer] = []

    def start(behaviour: Behaviour) -> MetricsServer:
        server = MetricsServer(behaviour)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/metrics"


HEALTHY_LOAD = EngineLoad(waiting=3, running=5, kv_usage=0.42, kv_blocks=1024, preemptions_total=7)


async def test_healthy_failing_hanging_and_refused_pods(start_server: StartServer) -> None:
    healthy = start_server(answer(200, engine_exposition(waiting=3, running=5, kv_usage=0.42)))
    failing = start_server(answer(500, "internal error"))
    hanging = start_server(hang)
    targets = [
        ScrapeTarget("prefill-a", "prefill", healthy.url),
        ScrapeTarget("prefill-b", "prefill", failing.url),
        ScrapeTarget("decode-a", "decode", hanging.url),
        ScrapeTarget("decode-b", "decode", closed_port_url(), ready=False),
    ]
    before = time.time()
    # 3 s: the healthy and failing pods (threads of this process) must answer within it under load.
    samples = await scrape_pods(targets, timeout_s=3, concurrency=4)
    after = time.time()

    assert [(s.pod, s.role, s.ready) for s in samples] == [
        ("prefill-a", "prefill", True),
        ("prefill-b", "prefill", True),
        ("decode-a", "decode", True),
        ("decode-b", "decode", False),
    ]
    assert samples[0].load == HEALTHY_LOAD and samples[0].error is None
    assert samples[1].load is None and samples[1].error == "HTTP 500"
    assert samples[2].load is None and samples[2].error == "timeout after 3s"
    assert samples[3].load is None and samples[3].error is not None
    assert samples[3].error.startswith("ConnectError")
    assert all(before <= s.scraped_at <= after for s in samples)
    # Concurrent: the hung pod costs one timeout, not one per pod.
    assert after - before < 6.0


async def test_a_slow_trickle_is_cut_at_the_total_timeout(start_server: StartServer) -> None:
    slow = start_server(trickle)
    before = time.monotonic()
    [sample] = await scrape_pods([ScrapeTarget("p", "prefill", slow.url)], timeout_s=0.4)
    assert (sample.load, sample.error) == (None, "timeout after 0.4s")
    assert time.monotonic() - before < 5.0  # uncut, the trickle would last until the server stops


async def test_an_incomplete_answer_is_unknown_with_the_missing_metric(start_server: StartServer) -> None:
    partial = start_server(answer(200, engine_exposition(omit=(contract.M_KV_USAGE,))))
    [sample] = await scrape_pods([ScrapeTarget("p", "prefill", partial.url)])
    assert (sample.load, sample.error) == (
        None,
        f"{contract.M_KV_USAGE}: missing from /metrics (and vllm:kv_cache_usage_perc)",
    )


async def test_a_bad_pod_address_is_unknown_and_does_not_spoil_the_others(start_server: StartServer) -> None:
    healthy = start_server(answer(200, engine_exposition()))
    samples = await scrape_pods(
        [
            ScrapeTarget("bad-port", "decode", "http://127.0.0.1:99999/metrics"),
            ScrapeTarget("no-scheme", "decode", "127.0.0.1:8000/metrics"),
            ScrapeTarget("good", "decode", healthy.url),
        ],
        timeout_s=30,  # only the healthy pod is waited for
    )
    assert [(s.load, s.error) for s in samples] == [
        (None, "OverflowError: connect(): port must be 0-65535."),
        (None, "UnsupportedProtocol: Request URL is missing an 'http://' or 'https://' protocol."),
        (HEALTHY_LOAD, None),
    ]


@pytest.mark.parametrize("bound", [2, 4])
async def test_concurrency_is_bounded(start_server: StartServer, bound: int) -> None:
    total = 4
    server = start_server(held(engine_exposition(), total, hold_s=1.0))
    targets = [ScrapeTarget(f"p{i}", "prefill", server.url) for i in range(total)]
    samples = await scrape_pods(targets, timeout_s=10, concurrency=bound)
    assert [s.load for s in samples] == [HEALTHY_LOAD] * total
    assert (server.arrived, server.max_in_flight) == (total, bound)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout_s: must be > 0, got 0"),
        ({"concurrency": 0}, "concurrency: must be >= 1, got 0"),
    ],
)
async def test_bad_scrape_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as info:
        await scrape_pods([], **kwargs)
    assert str(info.value) == message
