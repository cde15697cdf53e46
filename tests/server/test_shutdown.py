"""SIGTERM drains (in-flight requests complete, new ones are refused, exit 0) and the engine
core never outlives the server."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable

import httpx
import pytest

from tests.server.server_process import ServerProcess, child_pids, pid_alive, wait_for

MODEL = "tiny-chat"
pytestmark = pytest.mark.slow


def test_sigterm_during_load_finishes_in_flight_and_exits_0(
    start_tiny_server: Callable[..., ServerProcess],
) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]
    assert child_pids(server.pid) == [core_pid]
    num_clients, max_tokens = 16, 60

    async def one(client: httpx.AsyncClient, i: int, started: asyncio.Queue[int]) -> tuple[str | None, int]:
        body = {
            "model": MODEL,
            "prompt": f"client {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        finish, tokens, first = None, 0, True
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if first:
                    first = False
                    started.put_nowait(i)
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return finish, tokens

    async def main() -> tuple[list[tuple[str | None, int]], int, int, int]:
        started: asyncio.Queue[int] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as client:
            tasks = [asyncio.create_task(one(client, i, started)) for i in range(num_clients)]
            for _ in range(num_clients):
                await asyncio.wait_for(started.get(), 120)  # every stream is under way
            server.proc.send_signal(signal.SIGTERM)
            ready = await client.get("/ready")
            while ready.status_code == 200:  # the handler runs on the server's loop; poll until it has
                ready = await client.get("/ready")
            refused = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2}
            )
            return await asyncio.gather(*tasks), ready.status_code, refused.status_code, refused.json()

    results, ready_status, refused_status, refused_body = asyncio.run(main())
    assert results == [("length", max_tokens)] * num_clients
    assert ready_status == 503
    assert refused_status == 503
    assert refused_body["error"]["code"] == "draining"
    assert server.proc.wait(60) == 0
    server.stop()
    wait_for(lambda: not pid_alive(core_pid), 10, "the engine core to exit")
    assert "drained; stopping" in server.log_text()


def test_core_exits_when_the_server_is_killed(start_tiny_server: Callable[..., ServerProcess]) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]
    assert pid_alive(core_pid)
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(core_pid), 15, "the orphaned engine core to exit")


def test_idle_sigterm_exits_0_without_children(start_tiny_server: Callable[..., ServerProcess]) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]
    assert server.stop(signal.SIGTERM) == 0
    assert not pid_alive(core_pid)
