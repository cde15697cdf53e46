"""A fixed-rate streaming upstream for ``bench.router``: it plays both engine legs.

Prefill legs (``kv_transfer_params.do_remote_decode``) get a small JSON answer with
``kv_transfer_params``; every other request gets an SSE stream of ``chunks`` events, one every
``interval_ms``, each stamped with ``time.monotonic_ns()`` at the moment it is sent (CLOCK_MONOTONIC
is system-wide on Linux, so the client in another process can subtract it).

Run: ``python -m bench.router_upstream --port 9000 --interval-ms 20 --chunks 100``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]


class FixedRateUpstream:
    def __init__(self, interval_s: float, chunks: int) -> None:
        self.interval_s = interval_s
        self.chunks = chunks

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away before its request was complete
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            payload = b"ok" if scope["path"] == "/health" else b""
            await _whole(send, 200, b"text/plain", payload)
            return
        request = json.loads(body)
        if (request.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer = {
                "id": "bench",
                "choices": [{"index": 0, "text": "a"}],
                "kv_transfer_params": {"transfer_id": "bench", "block_ids": [0, 1, 2], "first_token": 1},
            }
            await _whole(send, 200, b"application/json", json.dumps(answer).encode())
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        start = time.monotonic()
        for i in range(self.chunks):
            delay = start + i * self.interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            chunk = (
                b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","model":"bench","choices":'
                b'[{"index":0,"delta":{"content":" token"},"finish_reason":null}],"t":'
                + str(time.monotonic_ns()).encode()
                + b"}\n\n"
            )
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _whole(
    send: Callable[[Message], Awaitable[None]], status: int, content_type: bytes, body: bytes
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def main() -> None:
    p = argparse.ArgumentParser(description="fixed-rate SSE upstream for bench.router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--chunks", type=int, default=100)
    args = p.parse_args()
    import uvicorn

    app = FixedRateUpstream(args.interval_ms / 1000, args.chunks)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
