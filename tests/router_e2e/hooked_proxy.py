"""An HTTP forwarder in front of one engine that runs a hook before each POST it forwards.

The router's decode leg goes through it, so a test can act exactly between the two legs (for
example kill the producer) and then let the real request reach the real consumer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.router.servers import ServerThread


def hooked_proxy(upstream: str, before_post: Callable[[bytes], None]) -> ServerThread:
    client = httpx.AsyncClient(base_url=upstream, timeout=120.0)

    async def forward(request: Request) -> Response:
        body = await request.body()
        if request.method == "POST":
            before_post(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream_request = client.build_request(
            request.method, request.url.path, content=body, headers=headers, params=request.query_params
        )
        answer = await client.send(upstream_request, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        passed = {
            k: v
            for k, v in answer.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding")
        }
        return StreamingResponse(relay(), status_code=answer.status_code, headers=passed)

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    return ServerThread(app).start()
