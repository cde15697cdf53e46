"""Requests held while the decode (or aggregated) pool has no pod: bounded in number and time,
released when a pod appears, 503 with Retry-After otherwise, and counted for the autoscaler."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from baton_engine import contract
from baton_engine.router.endpoints import Endpoint
from baton_support.wait import wait_for
from tests.router.test_proxy import _metric, _wait_metric

BODY = {"model": "smollm2", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
HELD = contract.M_ROUTER_HELD


def _post(url: str, request_id: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=BODY, headers={"X-Request-Id": request_id}, timeout=60)


def _held(router_url: str) -> float:
    return _metric(router_url, HELD)


def test_requests_wait_for_the_first_decode_pod_then_run(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(endpoints=[Endpoint(role="prefill", url=prefill_url)], hold_timeout_s=60)
    with ThreadPoolExecutor(3) as pool:
        sent = [pool.submit(_post, router.url, f"h{i}") for i in range(3)]
        wait_for(lambda: _held(router.url) == 3, message="three requests held")
        assert prefill.posts() == []  # nothing ran while decode had no pod
        ready = httpx.get(router.url + "/ready", timeout=30)
        assert (ready.status_code, ready.json()) == (
            200,
            {"status": "ready", "pods": {"prefill": 1, "decode": 0}},
        )
        router.discovery.add(Endpoint(role="decode", url=decode_url))
        answers = [f.result() for f in sent]
    assert [a.status_code for a in answers] == [200] * 3
    assert sorted(a.json()["id"] for a in answers) == ["h0", "h1", "h2"]
    assert sorted(r.request_id for r in decode.posts()) == ["h0", "h1", "h2"]
    assert _held(router.url) == 0
    _wait_metric(router.url, 'baton_router_held_requests_total{outcome="released"}', 3.0)
    _wait_metric(router.url, "baton_router_hold_duration_seconds_count", 3.0)


def test_a_full_queue_answers_503_with_retry_after_and_loses_no_held_request(
    start_engine, start_router
) -> None:
    decode, decode_url = start_engine("d0")
    router = start_router(hold_queue=2, hold_timeout_s=60, hold_retry_after_s=7)
    with ThreadPoolExecutor(2) as pool:
        held: list[Future[httpx.Response]] = [pool.submit(_post, router.url, f"q{i}") for i in range(2)]
        wait_for(lambda: _held(router.url) == 2, message="two requests held")
        refused = [_post(router.url, f"over{i}") for i in range(3)]
        router.discovery.add(Endpoint(role="decode", url=decode_url))
        answers = [f.result() for f in held]
    for response in refused:
        assert response.status_code == 503
        assert response.headers["retry-after"] == "7"
        assert response.json() == {
            "error": {
                "message": "no decode pod available and 2 requests already wait for one "
                "(the router holds at most 2)",
                "type": "service_unavailable",
                "param": None,
                "code": 503,
            }
        }
    assert [a.status_code for a in answers] == [200, 200]
    # No prefill pod: the held requests ran whole on the decode pod once it came.
    assert sorted(r.request_id for r in decode.posts()) == ["q0", "q1"]
    _wait_metric(router.url, 'baton_router_held_requests_total{outcome="rejected"}', 3.0)
    _wait_metric(router.url, 'baton_router_requests_total{mode="disaggregated",outcome="unavailable"}', 3.0)


def test_a_held_request_times_out_with_503(start_router) -> None:
    router = start_router(hold_timeout_s=0.5)
    response = _post(router.url, "t0")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"]["message"] == "no decode pod became available within 0.5 s"
    _wait_metric(router.url, 'baton_router_held_requests_total{outcome="timeout"}', 1.0)
    assert _held(router.url) == 0


def test_hold_queue_zero_answers_at_once_and_is_not_ready(start_router) -> None:
    router = start_router(hold_queue=0)
    response = _post(router.url, "z0")
    assert (response.status_code, response.headers["retry-after"]) == (503, "5")
    assert response.json()["error"]["message"] == "no decode pod available"
    ready = httpx.get(router.url + "/ready", timeout=30)
    assert ready.status_code == 503
    assert ready.json()["error"]["message"] == "not ready: no reachable prefill or decode pod"


def test_a_client_that_leaves_while_held_is_counted_and_freed(start_router) -> None:
    router = start_router(hold_timeout_s=60)

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(client.post(router.url + "/v1/completions", json=BODY))
            await asyncio.to_thread(wait_for, lambda: _held(router.url) == 1, message="one request held")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave())
    _wait_metric(router.url, 'baton_router_held_requests_total{outcome="cancelled"}', 1.0)
    assert _held(router.url) == 0


def test_aggregated_mode_holds_for_the_engine_pool(start_engine, start_router) -> None:
    engine, engine_url = start_engine("e0")
    router = start_router(mode="aggregated", hold_timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(_post, router.url, "a0")
        wait_for(lambda: _held(router.url) == 1, message="one request held")
        router.discovery.add(Endpoint(role="engine", url=engine_url))
        assert sent.result().status_code == 200
    assert [r.request_id for r in engine.posts()] == ["a0"]
