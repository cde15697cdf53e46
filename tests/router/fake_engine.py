"""An HTTP server that behaves like one engine pod's legs (the real engine has no server yet).

Prefill requests (``kv_transfer_params.do_remote_decode``) get a completion with
``kv_transfer_params``; other requests get a JSON completion or an SSE stream. Every request,
and every client disconnect the server notices, is recorded for the test to check.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")


@dataclass
class FakeEngine:
    name: str
    model: str = "smollm2"
    prefill_status: int = 200  # 200, or an error status to answer prefill legs with
    prefill_hang: bool = False  # never answer prefill legs (until the client goes away)
    prefill_without_params: bool = False
    chunks: int = 3  # SSE chunks per streamed answer (before [DONE])
    chunk_interval_s: float = 0.0
    stream_forever: bool = False
    stream_break_after: int | None = None  # abort the connection after this many chunks
    metrics_text: str = ""
    draining: bool = False  # answer every POST as an engine told to stop does (503 "draining")
    prefill_gate: threading.Event | None = None  # prefill legs are answered only once it is set
    requests: list[Recorded] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)  # request ids whose client went away
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def posts(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST"]

    def params_for(self, request_id: str) -> dict[str, Any]:
        return {
            "engine_id": self.name,
            "transfer_id": f"t-{request_id}",
            "block_ids": [1, 2],
            "first_token": 7,
        }

    def stream_bytes(self, request_id: str, n: int | None = None) -> bytes:
        """What a streamed answer of ``n`` chunks looks like on the wire (after HTTP framing)."""
        n = self.chunks if n is None else n
        return b"".join(self._chunk(request_id, i) for i in range(n)) + b"data: [DONE]\n\n"

    def _chunk(self, request_id: str, i: int) -> bytes:
        payload = {"id": request_id, "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def completion(self, request_id: str, text: str) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "served_by": self.name,
        }

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        parsed = json.loads(body) if body else None
        record = Recorded(scope["method"], scope["path"], headers, parsed)
        with self._lock:
            self.requests.append(record)
        rid = record.request_id
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await _whole(send, 200, "text/plain", self.metrics_text.encode())
        elif scope["method"] == "GET" and scope["path"] == "/v1/models":
            await _whole(
                send,
                200,
                "application/json",
                json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode(),
            )
        elif scope["method"] != "POST":
            await _whole(send, 404, "application/json", b'{"error":{"message":"not found"}}')
        elif self.draining:
            error = {"error": {"message": "shutting down", "type": "service_unavailable", "code": "draining"}}
            await _whole(send, 503, "application/json", json.dumps(error).encode())
        elif (parsed.get("kv_transfer_params") or {}).get("do_remote_decode"):
            await self._prefill(rid, receive, send)
        elif parsed.get("stream"):
            await self._stream(rid, receive, send)
        else:
            await _whole(send, 200, "application/json", json.dumps(self.completion(rid, "done")).encode())

    async def _prefill(self, rid: str, receive: Receive, send: Send) -> None:
        if self.prefill_gate is not None and not await asyncio.to_thread(self.prefill_gate.wait, 60):
            raise RuntimeError("fake engine: the prefill gate was never opened")
        if self.prefill_hang:
            while (await receive())["type"] != "http.disconnect":
                pass
            with self._lock:
                self.disconnects.append(rid)
            return
        if self.prefill_status != 200:
            error = {
                "error": {
                    "message": f"{self.name} refuses",
                    "type": "x",
                    "param": None,
                    "code": self.prefill_status,
                }
            }
            await _whole(send, self.prefill_status, "application/json", json.dumps(error).encode())
            return
        answer = self.completion(rid, "t0")
        if not self.prefill_without_params:
            answer["kv_transfer_params"] = self.params_for(rid)
        await _whole(send, 200, "application/json", json.dumps(answer).encode())

    async def _stream(self, rid: str, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        i = 0
        while self.stream_forever or i < self.chunks:
            if i == self.stream_break_after:
                watcher.cancel()
                raise RuntimeError("fake engine: stream broken on purpose")  # uvicorn drops the connection
            if gone.is_set():
                with self._lock:
                    self.disconnects.append(rid)
                return
            await send({"type": "http.response.body", "body": self._chunk(rid, i), "more_body": True})
            i += 1
            try:
                await asyncio.wait_for(gone.wait(), timeout=self.chunk_interval_s or 0.001)
            except TimeoutError:
                pass
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        watcher.cancel()


async def _whole(send: Send, status: int, content_type: str, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
