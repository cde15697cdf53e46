"""Load, client disconnects and the queue limit against real servers (tiny random model)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import httpx
import pytest

from baton_support.wait import wait_for
from tests.server.server_process import ServerProcess

MODEL = "tiny-chat"
pytestmark = pytest.mark.slow


async def _stream_one(client: httpx.AsyncClient, index: int, max_tokens: int) -> tuple[int, str | None, int]:
    """One streaming completion; returns (HTTP status, finish_reason, completion tokens)."""
    body = {
        "model": MODEL,
        "prompt": f"Request number {index}: hello",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish: str | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return 200, finish, tokens


def test_64_concurrent_streaming_clients_times_4(tiny_server: ServerProcess) -> None:
    async def client_loop(client: httpx.AsyncClient, c: int) -> list[tuple[int, str | None, int]]:
        return [await _stream_one(client, c * 4 + r, 8 + (c + r) % 9) for r in range(4)]

    async def main() -> list[list[tuple[int, str | None, int]]]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=300.0, limits=limits) as client:
            return await asyncio.gather(*(client_loop(client, c) for c in range(64)))

    results = asyncio.run(main())
    flat = [r for per_client in results for r in per_client]
    assert len(flat) == 256
    expected = [(200, "length", 8 + (c + r) % 9) for c in range(64) for r in range(4)]
    assert flat == expected
    stats = tiny_server.wait_idle()
    assert stats["num_used_kv_blocks"] == 0


def test_disconnected_streams_free_their_blocks(tiny_server: ServerProcess) -> None:
    aborted_before = tiny_server.aborted_requests(MODEL)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60.0) as client:
            for _ in range(4):
                body = {
                    "model": MODEL,
                    "prompt": "hello hello",
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    lines = response.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass
                # leaving the block closes the connection mid-stream

    asyncio.run(main())
    assert tiny_server.stats()["generation_tokens"] > 0
    stats = tiny_server.wait_idle(timeout=30)
    assert stats["num_used_kv_blocks"] == 0
    assert stats["num_running"] == 0
    # each dropped stream is counted once as an aborted request
    wait_for(
        lambda: tiny_server.aborted_requests(MODEL) >= aborted_before + 4,
        timeout=30,
        message="4 aborts in the request metric",
    )
    assert tiny_server.aborted_requests(MODEL) == aborted_before + 4


def test_disconnected_non_streaming_request_is_aborted(tiny_server: ServerProcess) -> None:
    before = tiny_server.stats()["generation_tokens"]
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 250, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # Disconnect once generation has started (a condition, not a timer: on an idle machine the
    # tiny model can finish 250 tokens within any fixed client timeout).
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as conn:
        conn.sendall(head + body)
        wait_for(
            lambda: tiny_server.stats()["generation_tokens"] > before,
            timeout=30,
            message="generation to start",
            interval=0.002,
        )
    stats = tiny_server.wait_idle(timeout=30)
    assert stats["generation_tokens"] - before < 250  # aborted before it could finish


def test_deadline_aborts_with_408(tiny_server: ServerProcess) -> None:
    aborted_before = tiny_server.aborted_requests(MODEL)
    response = tiny_server.http.post(
        "/v1/completions",
        # 250 engine steps and their outputs' trips to the server take well over 0.05 s on a CPU
        # (with 0.3 s a quiet machine answered in time: 200)
        json={"model": MODEL, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "timeout": 0.05},
    )
    assert response.status_code == 408
    assert tiny_server.aborted_requests(MODEL) == aborted_before + 1  # counted before the 408 was sent
    error = response.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["param"] == "timeout"
    assert tiny_server.wait_idle()["num_used_kv_blocks"] == 0


def test_over_the_queue_limit_gets_429(start_tiny_server: Callable[..., ServerProcess]) -> None:
    server = start_tiny_server("--max-num-seqs", "1", "--max-queued-requests", "1")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "stream": True}

    async def main() -> tuple[int, dict[str, object], str | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as client:
            async with client.stream("POST", "/v1/completions", json=body) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # the first request is running (it produced a token)
                async with client.stream("POST", "/v1/completions", json=body) as queued:
                    assert queued.status_code == 200
                    await asyncio.to_thread(
                        lambda: wait_for(
                            lambda: server.stats()["num_waiting"] == 1,
                            30,
                            message="the second request to queue",
                        )
                    )
                    over = await client.post("/v1/completions", json={**body, "stream": False})
                    return over.status_code, over.json(), over.headers.get("retry-after")

    status, body_json, retry_after = asyncio.run(main())
    assert status == 429
    assert retry_after == "1"
    assert body_json["error"]["code"] == "queue_full"  # type: ignore[index]
    assert server.wait_idle()["num_used_kv_blocks"] == 0


def test_metrics_expose_contract_names(tiny_server: ServerProcess) -> None:
    from baton_engine import contract

    response = tiny_server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "metrics please", "max_tokens": 5, "ignore_eos": True},
    )
    assert response.status_code == 200
    tiny_server.wait_idle()
    text = tiny_server.http.get("/metrics").text
    for name in (
        contract.M_REQUESTS_WAITING,
        contract.M_REQUESTS_RUNNING,
        contract.M_KV_USAGE,
        contract.M_PREFIX_QUERIES,
        contract.M_PREFIX_HITS,
        contract.M_PREEMPTIONS,
        contract.M_PROMPT_TOKENS,
        contract.M_GENERATION_TOKENS,
    ):
        assert f"\n{name}{{" in text, name
    for name in (contract.M_TTFT, contract.M_ITL, contract.M_E2E, contract.M_QUEUE_TIME):
        assert f"\n{name}_count{{" in text, name
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton_") and 'model_name="tiny-chat"' in line and "_bucket" not in line
    }
    assert samples[contract.M_KV_USAGE] == 0.0
    assert samples[contract.M_REQUESTS_RUNNING] == 0.0
    assert samples[contract.M_GENERATION_TOKENS] >= 5
    assert samples[contract.M_TTFT + "_count"] >= 1
