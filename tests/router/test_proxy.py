"""The router against real loopback HTTP servers that play prefill and decode pods."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import pytest

from baton_support.wait import wait_for
from tests.router.servers import dead_url

ERROR_KEYS = {"message", "type", "param", "code"}
BODY = {"model": "smollm2", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
STREAM_BODY = {**BODY, "stream": True, "stream_options": {"include_usage": True}}


def _metric(router_url: str, line_start: str) -> float:
    text = httpx.get(router_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def _wait_metric(router_url: str, line_start: str, value: float) -> None:
    """Until the sample reads `value`: the router counts a request's outcome (and observes its
    last leg) after the response's last byte went out, so a client can scrape first."""
    wait_for(lambda: _metric(router_url, line_start) == value, message=f"{line_start} == {value}")


def test_disaggregated_legs_in_order_with_params_passed_through(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    response = httpx.post(
        router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "req-1"}, timeout=30
    )

    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-1"
    assert response.json() == decode.completion("req-1", "done")
    [prefill_leg] = prefill.posts()
    [decode_leg] = decode.posts()
    assert prefill_leg.path == decode_leg.path == "/v1/completions"
    assert prefill_leg.body == {
        **BODY,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode_leg.body == {**BODY, "kv_transfer_params": prefill.params_for("req-1")}
    assert prefill_leg.request_id == decode_leg.request_id == "req-1"
    _wait_metric(router.url, 'baton_router_requests_total{mode="disaggregated",outcome="success"}', 1.0)
    assert len(prefill.posts()) == 1  # the decode leg completed: no lease release


def test_stream_is_relayed_byte_for_byte(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0", chunks=5)
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        headers={"X-Request-Id": "s-1"},
        json={**STREAM_BODY, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        received = b"".join(response.iter_raw())

    assert received == decode.stream_bytes("s-1", 5)
    [prefill_leg] = prefill.posts()
    assert prefill_leg.path == "/v1/chat/completions"
    assert "stream_options" not in prefill_leg.body and prefill_leg.body["stream"] is False
    assert (prefill_leg.body["max_tokens"], prefill_leg.body["max_completion_tokens"]) == (1, 1)
    [decode_leg] = decode.posts()
    assert decode_leg.body["stream_options"] == {"include_usage": True}
    assert decode_leg.body["kv_transfer_params"] == prefill.params_for("s-1")


def test_upstream_stream_breaking_midway_ends_with_an_sse_error(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0", chunks=5, stream_break_after=2)
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    with httpx.stream(
        "POST", router.url + "/v1/completions", json=STREAM_BODY, headers={"X-Request-Id": "b-1"}, timeout=30
    ) as r:
        assert r.status_code == 200
        received = b"".join(r.iter_raw())

    complete = decode.stream_bytes("b-1", 2).removesuffix(b"data: [DONE]\n\n")
    assert received.startswith(complete)
    error = json.loads(received[len(complete) :].removeprefix(b"data: "))
    assert set(error["error"]) == ERROR_KEYS
    assert error["error"]["type"] == "upstream_error"
    assert error["error"]["message"].startswith(f"upstream {decode_url} stream broke")
    _wait_metric(
        router.url, 'baton_router_requests_total{mode="disaggregated",outcome="upstream_error"}', 1.0
    )


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_client_kv_transfer_params_are_dropped(start_engine, start_router, mode) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    if mode == "aggregated":
        router = start_router(engine=[decode_url], mode="aggregated")
    else:
        router = start_router(prefill=[prefill_url], decode=[decode_url])
    forged = {**BODY, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "stolen"}}

    response = httpx.post(
        router.url + "/v1/completions", json=forged, headers={"X-Request-Id": "k-1"}, timeout=30
    )

    assert response.status_code == 200
    [decode_leg] = decode.posts()
    if mode == "aggregated":
        assert decode_leg.body == BODY
    else:
        assert decode_leg.body == {**BODY, "kv_transfer_params": prefill.params_for("k-1")}
        assert prefill.posts()[0].body["kv_transfer_params"] == {"do_remote_decode": True}


def test_request_id_is_generated_and_shared_by_both_legs(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    rid = response.headers["x-request-id"]
    assert re.fullmatch(r"baton-[0-9a-f]{32}", rid)
    assert [r.request_id for r in prefill.posts()] == [rid]
    assert [r.request_id for r in decode.posts()] == [rid]


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        ({"prefill_status": 500}, "status"),
        ({"prefill_status": 503}, "status"),
        ({"prefill_without_params": True}, "bad_response"),
        ({"prefill_hang": True}, "timeout"),
    ],
)
def test_prefill_failure_sends_the_whole_request_to_decode(
    start_engine, start_router, behaviour, reason
) -> None:
    prefill, prefill_url = start_engine("p0", **behaviour)
    decode, decode_url = start_engine("d0")
    # A short prefill timeout only where the timeout is the failure: a loaded machine can keep an
    # answering prefill pod (a thread of this process) past 0.3 s, and that would read as "timeout".
    timeout_s = 0.3 if behaviour.get("prefill_hang") else 30.0
    router = start_router(prefill=[prefill_url], decode=[decode_url], prefill_timeout_s=timeout_s)

    response = httpx.post(
        router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "f-1"}, timeout=30
    )

    assert response.status_code == 200
    assert response.json() == decode.completion("f-1", "done")
    [decode_leg] = decode.posts()
    assert decode_leg.body == BODY  # original body: no kv_transfer_params
    assert decode_leg.request_id == "f-1"
    assert _metric(router.url, f'baton_router_fallbacks_total{{reason="{reason}"}}') == 1.0
    if behaviour.get("prefill_hang"):  # the timed-out prefill leg was closed, not left running
        wait_for(lambda: prefill.disconnects == ["f-1"], message="prefill pod to see the leg closed")


def test_unreachable_prefill_pod_falls_back(start_engine, start_router) -> None:
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[dead_url()], decode=[decode_url])

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    assert response.status_code == 200
    assert [r.body for r in decode.posts()] == [BODY]
    assert _metric(router.url, 'baton_router_fallbacks_total{reason="connect"}') == 1.0


def test_prefill_client_error_is_returned_and_decode_never_called(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0", prefill_status=400)
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    response = httpx.post(
        router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "e-1"}, timeout=30
    )

    assert response.status_code == 400
    assert response.json()["error"]["message"] == "p0 refuses"
    assert response.headers["x-request-id"] == "e-1"
    assert decode.posts() == []


def test_aggregated_mode_forwards_the_body_unchanged(start_engine, start_router) -> None:
    engine, engine_url = start_engine("e0")
    router = start_router(engine=[engine_url], mode="aggregated")
    raw = b'{"model":"smollm2",  "prompt":"x", "stream":true}'

    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json", "x-request-id": "a-1"},
        timeout=30,
    ) as response:
        received = b"".join(response.iter_raw())

    assert received == engine.stream_bytes("a-1")
    [leg] = engine.posts()
    assert leg.body == json.loads(raw)
    _wait_metric(router.url, 'baton_router_requests_total{mode="aggregated",outcome="success"}', 1.0)


def test_client_disconnect_mid_stream_closes_the_decode_leg(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0", stream_forever=True, chunk_interval_s=0.02)
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    with httpx.stream(
        "POST", router.url + "/v1/completions", json=STREAM_BODY, headers={"X-Request-Id": "c-1"}, timeout=30
    ) as response:
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    # leaving the block closed the client connection mid-stream
    wait_for(lambda: decode.disconnects == ["c-1"], message="decode pod to see its stream closed")
    # and the prefill pod is asked to free the blocks it leased for the abandoned decode leg
    wait_for(lambda: len(prefill.posts()) == 2, message="the lease release to reach the prefill pod")
    release = prefill.posts()[1]
    assert (release.path, release.body) == (
        "/v1/kv_transfer/release",
        {"kv_transfer_params": prefill.params_for("c-1")},
    )
    assert release.request_id == "c-1"
    _wait_metric(router.url, 'baton_router_requests_total{mode="disaggregated",outcome="cancelled"}', 1.0)


def test_client_disconnect_during_prefill_closes_the_prefill_leg(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0", prefill_hang=True)
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])
    body = json.dumps(BODY).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
        b"x-request-id: c-2\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    with socket.create_connection(("127.0.0.1", router.server.port)) as client:
        client.sendall(request)
        wait_for(lambda: prefill.posts(), message="prefill leg to arrive")
    wait_for(lambda: prefill.disconnects == ["c-2"], message="prefill pod to see its leg closed")
    assert decode.posts() == []


def test_api_key(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url], api_key="sekret")

    missing = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    wrong = httpx.post(
        router.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    models = httpx.get(router.url + "/v1/models", timeout=30)
    right = httpx.post(
        router.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer sekret"}, timeout=30
    )

    for denied in (missing, wrong, models):
        assert denied.status_code == 401
        assert set(denied.json()["error"]) == ERROR_KEYS
        assert denied.json()["error"]["type"] == "invalid_request_error"
        assert denied.json()["error"]["code"] == "invalid_api_key"
    assert missing.json()["error"]["message"].startswith("Missing API key")
    assert wrong.json()["error"]["message"] == "Incorrect API key provided."
    assert right.status_code == 200
    assert len(decode.posts()) == 1
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200  # probes need no key


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "request body: not valid JSON"),
        (b"[1, 2]", "request body: must be a JSON object"),
    ],
)
def test_bad_request_bodies_get_openai_errors(start_engine, start_router, content, message) -> None:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])

    response = httpx.post(router.url + "/v1/completions", content=content, timeout=30)

    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(message)
    assert decode.posts() == []


def test_unknown_paths_and_methods_get_openai_errors(start_engine, start_router) -> None:
    _, decode_url = start_engine("e0")
    router = start_router(engine=[decode_url], mode="aggregated")

    missing = httpx.post(router.url + "/v1/embeddings", json={}, timeout=30)
    wrong_method = httpx.get(router.url + "/v1/completions", timeout=30)

    assert (missing.status_code, wrong_method.status_code) == (404, 405)
    assert missing.json() == {
        "error": {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": 404}
    }
    assert wrong_method.json()["error"]["message"] == "Method Not Allowed"


def test_no_reachable_decode_pod_is_503(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    router = start_router(prefill=[prefill_url], decode=[dead_url(), dead_url()])

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "service_unavailable"
    assert error["message"].startswith("decode leg: no pod accepted the connection")
    # nobody will pull the prefill pod's blocks: it is asked to free them now
    wait_for(lambda: len(prefill.posts()) == 2, message="the lease release to reach the prefill pod")
    assert [r.path for r in prefill.posts()] == ["/v1/completions", "/v1/kv_transfer/release"]


def test_refused_decode_pod_is_skipped_for_the_next(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d1")
    # the dead pod sorts first by key, so it is tried first
    router = start_router(
        prefill=[prefill_url], decode=[dead_url().replace("127.0.0.1", "127.0.0.2"), decode_url]
    )

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    assert response.status_code == 200
    assert len(decode.posts()) == 1


def test_draining_decode_pod_is_skipped_for_the_next(start_engine, start_router) -> None:
    # A pod told to stop refuses new requests (503 "draining") before the router's watch shows
    # its deletion: the request goes to the next decode pod, and the client never sees the 503.
    _, prefill_url = start_engine("p0")
    # The draining pod looks idler, so it is tried first.
    draining, draining_url = start_engine(
        "d0", draining=True, metrics_text="baton_kv_cache_usage_ratio 0.1\n"
    )
    decode, decode_url = start_engine("d1", metrics_text="baton_kv_cache_usage_ratio 0.9\n")
    router = start_router(prefill=[prefill_url], decode=[draining_url, decode_url])
    router.wait_scraped()

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    assert response.status_code == 200, response.text
    assert response.json()["served_by"] == "d1"
    assert (len(draining.posts()), len(decode.posts())) == (1, 1)


def test_only_draining_decode_pods_is_503(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    _, draining_url = start_engine("d0", draining=True)
    router = start_router(prefill=[prefill_url], decode=[draining_url])

    response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        f"decode leg: no pod accepted the connection ({draining_url}: draining)"
    )


def test_pods_that_refuse_scrapes_get_no_requests(start_engine, start_router) -> None:
    prefill, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    router = start_router(prefill=[dead_url(), prefill_url], decode=[dead_url(), decode_url])
    router.wait_scraped()

    for _ in range(4):
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).status_code == 200

    assert (len(prefill.posts()), len(decode.posts())) == (4, 4)
    assert _metric(router.url, 'baton_router_fallbacks_total{reason="connect"}') == 0.0


def test_ready_needs_a_reachable_pod_of_each_role(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    _, decode_url = start_engine("d0")
    up = start_router(prefill=[prefill_url], decode=[decode_url])
    half = start_router(prefill=[prefill_url], decode=[dead_url()])
    up.wait_scraped()
    half.wait_scraped()

    ready = httpx.get(up.url + "/ready", timeout=30)
    not_ready = httpx.get(half.url + "/ready", timeout=30)

    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "pods": {"prefill": 1, "decode": 1}}
    assert not_ready.status_code == 503
    assert not_ready.json()["error"]["message"] == "not ready: no reachable decode pod"


def test_models_are_merged_from_the_upstreams(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0", model="smollm2")
    _, decode_url = start_engine("d0", model="other")
    router = start_router(prefill=[prefill_url], decode=[decode_url, dead_url()])

    response = httpx.get(router.url + "/v1/models", timeout=30)

    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["other", "smollm2"]


def test_decode_pod_chosen_by_kv_usage(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    busy, busy_url = start_engine("busy", metrics_text="baton_kv_cache_usage_ratio 0.9\n")
    idle, idle_url = start_engine("idle", metrics_text="baton_kv_cache_usage_ratio 0.1\n")
    router = start_router(prefill=[prefill_url], decode=[busy_url, idle_url])
    router.wait_scraped()

    for _ in range(3):
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).status_code == 200

    assert len(idle.posts()) == 3
    assert busy.posts() == []


def test_metrics_names(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    _, decode_url = start_engine("d0")
    router = start_router(prefill=[prefill_url], decode=[decode_url])
    httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)

    _wait_metric(router.url, 'baton_router_leg_duration_seconds_count{leg="decode"}', 1.0)
    text = httpx.get(router.url + "/metrics", timeout=30).text

    assert 'baton_router_leg_duration_seconds_count{leg="prefill"} 1.0' in text
    assert 'baton_router_leg_duration_seconds_count{leg="decode"} 1.0' in text
    assert "baton_router_time_to_first_byte_seconds_count 1.0" in text
    assert 'baton_router_endpoints{role="prefill"} 1.0' in text
    assert "baton_router_prefix_hit_tokens_total 0.0" in text


def test_concurrent_streams_all_complete_and_leave_nothing_in_flight(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    decodes = [start_engine(f"d{i}", chunks=20) for i in range(2)]
    router = start_router(prefill=[prefill_url], decode=[url for _, url in decodes])

    async def one(client: httpx.AsyncClient, i: int) -> bytes:
        headers = {"X-Request-Id": f"m-{i}"}
        async with client.stream(
            "POST", router.url + "/v1/completions", json=STREAM_BODY, headers=headers
        ) as r:
            return b"".join([chunk async for chunk in r.aiter_raw()])

    async def run() -> list[bytes]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    bodies = asyncio.run(run())

    assert bodies == [decodes[0][0].stream_bytes(f"m-{i}", 20) for i in range(48)]
    assert len(decodes[0][0].posts()) + len(decodes[1][0].posts()) == 48
    assert min(len(decodes[0][0].posts()), len(decodes[1][0].posts())) > 0  # both pods used
    # the last byte reaches the client a moment before the router's bookkeeping finishes
    wait_for(lambda: sum(router.core.in_flight.values()) == 0, message="in-flight counts back to zero")
