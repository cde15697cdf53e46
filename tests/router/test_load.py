"""Load scraping: the text parser and the tracker against real loopback servers."""

from __future__ import annotations

import asyncio

import aiohttp

from baton_engine.router.endpoints import EndpointRegistry, static_endpoint
from baton_engine.router.load import Load, LoadTracker, parse_load
from tests.router.servers import dead_url

EXPOSITION = """\
# HELP baton_num_requests_waiting Requests waiting
# TYPE baton_num_requests_waiting gauge
baton_num_requests_waiting{model="smollm2"} 3.0
baton_num_requests_waiting_created 1.7e9
baton_num_requests_running{model="smollm2",rank="0"} 2
baton_num_requests_running{model="smollm2",rank="1"} 5
baton_kv_cache_usage_ratio 0.25 1700000000000
baton_kv_cache_usage_ratio_other 9
baton_prompt_tokens_total 100
"""


def test_parse_load_sums_label_sets_and_ignores_other_metrics() -> None:
    assert parse_load(EXPOSITION) == {
        "baton_num_requests_waiting": 3.0,
        "baton_num_requests_running": 7.0,
        "baton_kv_cache_usage_ratio": 0.25,
    }


def test_parse_load_skips_garbage() -> None:
    text = (
        'baton_num_requests_waiting{a="b" 4\nbaton_num_requests_running NaN\nbaton_kv_cache_usage_ratio x\n'
    )
    assert parse_load(text) == {}


def test_tracker_reads_live_pods_and_marks_dead_ones(start_engine) -> None:
    _, live_url = start_engine("live", metrics_text=EXPOSITION)
    _, empty_url = start_engine("empty", metrics_text="")
    gone_url = dead_url()
    registry = EndpointRegistry()
    live, empty, gone = (static_endpoint("decode", u) for u in (live_url, empty_url, gone_url))

    async def scrape() -> list[Load]:
        async with aiohttp.ClientSession() as client:
            tracker = LoadTracker(registry, client, timeout_s=30.0)  # the dead pod is refused at once
            for endpoint in (live, empty, gone):
                registry.upsert(endpoint)
            await tracker.scrape_once()
            loads = [tracker.get(e.key) for e in (live, empty, gone)]
            registry.remove(live.key)
            loads.append(tracker.get(live.key))  # forgotten with the pod
            return loads

    live_load, empty_load, gone_load, removed = asyncio.run(scrape())
    assert (live_load.waiting, live_load.running, live_load.kv_usage, live_load.reachable) == (
        3.0,
        7.0,
        0.25,
        True,
    )
    assert (empty_load.waiting, empty_load.kv_usage, empty_load.reachable) == (None, None, True)
    assert (gone_load.waiting, gone_load.reachable) == (None, False)
    assert removed == Load()
