"""A P/D producer (prefill role, tiny random model) whose non-streaming client goes away.

The producer leg's answer carries the signed `kv_transfer_params` the router passes on to the
consumer, and the producer holds its KV blocks under a lease until the consumer pulls them.
A client that is gone will never pass the params on, so the lease must end at once (not at its
expiry, a minute here) and every KV block be free again; the server must go on serving.

- Path 1 (the client drops while the request runs), over a real socket to a real server: the
  engine core is stopped (SIGSTOP) so that the request cannot finish before the server saw
  the disconnect, whatever the machine's load.
- Path 2 (a late disconnect: generation finished, the answer not yet sent) and the race of
  the two (the disconnect seen while the final output is on its way, unread) are a matter of
  one event-loop turn, which no outside client can aim at: these run the real app and a real
  engine core in-process, with an ASGI receive channel that disconnects at the moment the
  core's final output reaches the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_engine.config import EngineConfig
from baton_engine.core.outputs import RequestOutput
from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.server.app import build_app
from baton_engine.server.engine_client import EngineClient
from baton_engine.server.metrics import EngineMetrics
from baton_engine.server.state import ServerState, max_token_chars
from baton_support.ports import free_port
from baton_support.wait import async_wait_for, wait_for
from tests.pd_setup import pd_environment
from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.server_process import ServerProcess, pid_alive

MODEL = "tiny-chat"
LEASE_SECONDS = 60  # far longer than any test: a lease that ends must have been released
PD_LEG = {"do_remote_decode": True}

pytestmark = pytest.mark.slow


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": PD_LEG}


def _idle(stats: dict[str, Any]) -> bool:
    return (
        stats["kv_leases_held"] == 0
        and stats["num_used_kv_blocks"] == 0
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0
    )


# ----------------------------------------------------------------------- a real server, path 1


@pytest.fixture(scope="module")
def producer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("producer-log") / "producer.log"
    with pd_environment():
        server = ServerProcess(
            str(tiny_model_dir),
            *TINY_SERVER_ARGS,
            "--kv-role", "producer",
            "--kv-lease-seconds", str(LEASE_SECONDS),
            "--kv-transfer-port", str(free_port()),
            log_path=log,
        )  # fmt: skip
    core_pid = server.core_pid
    try:
        yield server
    finally:
        if core_pid is not None and pid_alive(core_pid):
            os.kill(core_pid, signal.SIGCONT)  # a test that failed while it was stopped
        server.stop(signal.SIGKILL, timeout=10)  # SIGTERM would wait for a held lease
        if core_pid is not None:
            wait_for(lambda: not pid_alive(core_pid), timeout=10, message=f"core {core_pid} to exit")


def _logged(server: ServerProcess, text: str) -> bool:
    return text in server.log_text()


def test_client_gone_mid_request_aborts_it_and_holds_no_lease(producer: ServerProcess) -> None:
    core_pid = int(producer.stats()["core_pid"])
    aborted_before = producer.aborted_requests(MODEL)
    request_id = "producer-leg-dropped"
    body = json.dumps(_body("The capital of France is")).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    os.kill(core_pid, signal.SIGSTOP)  # the request is sent to the core but cannot run
    try:
        with socket.create_connection(("127.0.0.1", producer.port)) as conn:
            conn.sendall(head + body)
            wait_for(
                lambda: _logged(producer, f"request {request_id}: completion"),
                timeout=30,
                message="the server to take the request",
                interval=0.01,
            )
        # the socket is closed; the server must notice while the request is still open
        wait_for(
            lambda: _logged(producer, f"request {request_id}: client disconnected; aborting"),
            timeout=30,
            message="the server to abort the request of the gone client",
            interval=0.01,
        )
    finally:
        os.kill(core_pid, signal.SIGCONT)

    stats = wait_for(
        lambda: (s := producer.stats())["in_flight"] == 0 and _idle(s) and s,
        timeout=30,
        message="no request, lease or KV block left",
    )
    assert (stats["in_flight"], stats["kv_leases_held"], stats["num_used_kv_blocks"]) == (0, 0, 0)
    assert stats["kv_transfer"]["leases_expired"] == 0
    assert producer.aborted_requests(MODEL) == aborted_before + 1
    assert f"request {request_id}: done" not in producer.log_text()

    # The same server still answers a producer leg, and its lease is the only one.
    answer = producer.http.post("/v1/completions", json=_body("The capital of France is"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1
    params = answer.json()["kv_transfer_params"]
    assert params["num_tokens"] == answer.json()["usage"]["prompt_tokens"]
    wait_for(lambda: producer.stats()["kv_leases_held"] == 1, timeout=30, message="its lease")
    released = producer.http.post("/v1/kv_transfer/release", json={"kv_transfer_params": params})
    assert released.status_code == 200, released.text
    assert released.json() == {"transfer_id": params["transfer_id"], "released": True}
    stats = wait_for(lambda: _idle(s := producer.stats()) and s, timeout=30, message="the lease released")
    assert (stats["kv_leases_held"], stats["num_used_kv_blocks"]) == (0, 0)


# --------------------------------------------------------- the app in-process, path 2 and the race


class Channel:
    """An ASGI receive/send pair: the request body, then (when told) a disconnect.

    `close()` wakes a pending receive (the handler's disconnect watcher returns); `close_quietly()`
    only makes the next receive answer a disconnect (what a poll such as is_disconnected() sees
    first), the pending one stays asleep."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()
        self._body_sent = False
        self._gone = False
        self._woken = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    def close(self) -> None:
        self._gone = True
        self._woken.set()

    def close_quietly(self) -> None:
        self._gone = True

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self._gone:
            await self._woken.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


class InProcess:
    def __init__(self, state: ServerState, client: EngineClient) -> None:
        self.state = state
        self.client = client
        self.app = build_app(state)
        self.on_final: Callable[[Channel], bool] | None = None
        """Called when a request's final output reaches its queue; True holds the output back
        (it stays unread, as when the handler is cancelled first)."""
        self.held: list[RequestOutput] = []
        self._channel: Channel | None = None
        add = client.add

        def add_watched(request_id: str, prompt: Any, params: Any, queue: Any, *args: Any, **kw: Any) -> None:
            put = queue.put_nowait
            channel = self._channel

            def put_watched(item: Any) -> None:
                hook = self.on_final
                final = isinstance(item, RequestOutput) and item.finished
                if final and channel is not None and hook is not None and hook(channel):
                    self.held.append(item)
                    return
                put(item)

            queue.put_nowait = put_watched
            add(request_id, prompt, params, queue, *args, **kw)

        client.add = add_watched  # type: ignore[method-assign]

    async def post(self, path: str, channel: Channel) -> Channel:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(channel.body)).encode()),
            ],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
        }
        self._channel = channel
        try:
            await self.app(scope, channel.receive, channel.send)
        finally:
            self._channel = None
        return channel

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.call("stats")
        return result

    async def wait_idle(self) -> dict[str, Any]:
        async def idle() -> dict[str, Any] | None:
            stats = await self.stats()
            return stats if _idle(stats) and self.state.in_flight == 0 else None

        result: dict[str, Any] = await async_wait_for(
            idle, timeout=30, message="no request, lease or KV block left"
        )
        return result


@pytest.fixture
async def in_process(tiny_model_dir: Path) -> AsyncIterator[InProcess]:
    with pd_environment():
        config = EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            num_kv_blocks=64,
            max_model_len=256,
            kv_role="producer",
            kv_lease_seconds=LEASE_SECONDS,
            kv_transfer_port=free_port(),
        )
        client = EngineClient(config)
        await client.start(timeout=120)
        try:
            state = ServerState(config=config, metrics=EngineMetrics("", block_size=config.block_size))
            state.tokenizer = load_tokenizer(config.model)
            state.max_token_chars = max_token_chars(state.tokenizer)
            state.engine_started(client)
            yield InProcess(state, client)
        finally:
            await client.close()


async def _still_serves(server: InProcess) -> None:
    """A following producer leg is answered, with the one lease that holds then."""
    server.on_final = None
    answer = await server.post("/v1/completions", Channel(_body("One more, please")))
    assert answer.status == 200, answer.sent
    params = answer.json()["kv_transfer_params"]
    assert answer.json()["usage"]["completion_tokens"] == 1

    async def one_lease() -> bool:
        return (await server.stats())["kv_leases_held"] == 1

    await async_wait_for(one_lease, timeout=30, message="its lease")
    released = await server.post("/v1/kv_transfer/release", Channel({"kv_transfer_params": params}))
    assert released.json() == {"transfer_id": params["transfer_id"], "released": True}
    stats = await server.wait_idle()
    assert (stats["kv_leases_held"], stats["num_used_kv_blocks"]) == (0, 0)


def _check_released(stats: dict[str, Any]) -> None:
    assert (stats["kv_leases_held"], stats["num_used_kv_blocks"]) == (0, 0)
    assert stats["kv_transfer"]["leases_expired"] == 0


@pytest.mark.parametrize("seen_by", ["poll", "watcher"])
async def test_late_disconnect_releases_the_lease(
    in_process: InProcess, caplog: pytest.LogCaptureFixture, seen_by: str
) -> None:
    """The disconnect comes with the final output: generation finished, the lease is held, the
    answer with its params is not sent. `poll`: the watcher is still asleep, the check after
    generation sees it (is_disconnected()); `watcher`: the watcher returned in the same turn."""
    caplog.set_level(logging.INFO, logger="baton_engine.server")

    def disconnect(channel: Channel) -> bool:
        if seen_by == "poll":
            channel.close_quietly()
        else:
            channel.close()
        return False  # the output is read: generation finishes

    in_process.on_final = disconnect
    dropped = await in_process.post("/v1/completions", Channel(_body("The capital of France is")))
    assert dropped.status == 499
    assert "client gone before its kv_transfer_params; releasing" in caplog.text
    assert "client disconnected; aborting" not in caplog.text
    _check_released(await in_process.wait_idle())
    await _still_serves(in_process)


async def test_disconnect_before_the_final_output_is_read_releases_the_lease(
    in_process: InProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The race: the core finished the prefill and leased its blocks, its final output reached
    the server (which forgot the request: nothing more will come for it), but the handler sees
    the disconnect before it reads that output and cancels generation. The abort must still reach
    the core, which releases the lease of the finished request."""
    caplog.set_level(logging.INFO, logger="baton_engine.server")

    def disconnect(channel: Channel) -> bool:
        channel.close()
        return True  # held back: unread when the handler cancels

    in_process.on_final = disconnect
    dropped = await in_process.post("/v1/completions", Channel(_body("The capital of France is")))
    assert dropped.status == 499
    assert "client disconnected; aborting" in caplog.text
    assert len(in_process.held) == 1 and in_process.held[0].kv_transfer_params is not None
    _check_released(await in_process.wait_idle())
    await _still_serves(in_process)
