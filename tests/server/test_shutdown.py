"""SIGTERM drains (in-flight requests complete, new ones are refused, exit 0) and the engine
core never outlives the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable

import httpx
import pytest

from baton_support.wait import wait_for
from tests.server.server_process import ServerProcess, child_pids, pid_alive

MODEL = "tiny-chat"
pytestmark = pytest.mark.slow


def _exited(pid: int) -> bool:
    """`pid` has exited as its parent's waitpid sees it: gone, or a zombie with no thread left
    (a killed process's main thread turns zombie before its other threads have exited)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return not pid_alive(pid) and len(threads) <= 1


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
            deadline = asyncio.get_running_loop().time() + 10
            while ready.status_code == 200:  # the signal is handled on the server's loop; poll for it
                assert asyncio.get_running_loop().time() < deadline, "/ready stayed 200 after SIGTERM"
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
    wait_for(lambda: not pid_alive(core_pid), timeout=10, message="the engine core to exit")
    assert "drained; stopping" in server.log_text()


def test_core_exits_when_the_server_is_killed(start_tiny_server: Callable[..., ServerProcess]) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]
    assert pid_alive(core_pid)
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(core_pid), timeout=15, message="the orphaned engine core to exit")


def test_not_ready_while_loading_then_idle_sigterm_exits_0(
    start_tiny_server: Callable[..., ServerProcess],
) -> None:
    server = start_tiny_server(wait_ready=False)
    wait_for(lambda: server.answers("/health") == 200, timeout=120, message="/health to answer")
    # the engine core is a fresh interpreter importing torch: it cannot be ready this soon
    ready = server.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": "loading"})
    refused = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "loading")
    models = server.http.get("/v1/models")
    assert (models.status_code, models.json()["error"]["code"]) == (503, "loading")
    server.wait_ready()
    assert [m["id"] for m in server.http.get("/v1/models").json()["data"]] == [MODEL]
    log = server.log_text()
    assert "running on" not in log.lower()  # uvicorn's banner would precede the model's loading
    progress = [
        "loading the tokenizer of",
        "starting the engine core",
        "core: engine core",
        f"core: loading {MODEL} from",
        "core: engine core ready in",
        "ready in ",
    ]
    positions = [log.find(line) for line in progress]
    assert -1 not in positions and positions == sorted(positions), log
    assert f"serving {MODEL} on http://127.0.0.1:{server.port} (" in log
    core_pid = server.stats()["core_pid"]
    assert server.stop(signal.SIGTERM) == 0
    assert not pid_alive(core_pid)


def test_not_ready_the_moment_the_engine_core_is_gone(
    start_tiny_server: Callable[..., ServerProcess],
) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]
    assert server.http.get("/ready").status_code == 200
    os.kill(core_pid, signal.SIGKILL)
    wait_for(lambda: _exited(core_pid), timeout=30, message="the killed core to have exited")
    ready = server.http.get("/ready")  # the first ask after the exit, whatever the watchdog's period
    assert (ready.status_code, ready.json()) == (
        503,
        {"ready": False, "reason": "engine dead: engine core exited with code -9"},
    )
    assert server.http.get("/health").status_code == 503
    models = server.http.get("/v1/models")
    assert (models.status_code, models.json()["error"]["code"]) == (503, "engine_dead")
    refused = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "engine_dead")
    assert server.stop(signal.SIGTERM) == 0


def test_engine_core_crash_fails_open_requests_cleanly(
    start_tiny_server: Callable[..., ServerProcess],
) -> None:
    server = start_tiny_server()
    core_pid = server.stats()["core_pid"]

    async def main() -> tuple[int, str]:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                os.kill(core_pid, signal.SIGKILL)
                rest = [line async for line in lines if line.startswith("data: ")]
                return response.status_code, "\n".join(rest)

    status, rest = asyncio.run(main())
    assert status == 200
    assert '"code": "engine_dead"' in rest and rest.endswith("data: [DONE]")
    health = server.http.get("/health")
    assert health.status_code == 503
    assert server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 503
    assert server.stop(signal.SIGTERM) == 0
