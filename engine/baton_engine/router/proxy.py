"""One client request's trip through the upstream legs, as an ASGI response.

The response object runs the legs itself so that it can (1) watch the client connection the
whole time and cancel every open leg when the client goes away, and (2) send the upstream status
and bytes back unchanged: the decode stream is relayed chunk by chunk as it arrives, never
parsed.

The legs use aiohttp rather than httpx: on the bench (32 streams, 50 events/s each) relaying a
chunk cost the router about 60 us of CPU with aiohttp against about 120 us with httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import aiohttp
from starlette.background import BackgroundTasks
from starlette.responses import Response

from baton_engine import contract
from baton_engine.router import errors
from baton_engine.router.core import NoEndpoint, RouterCore
from baton_engine.router.endpoints import Endpoint
from baton_engine.router.hold import PoolUnavailable
from baton_engine.router.prefix import Api

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_HEADER = "x-request-id"
#: Upstream response headers passed to the client; the rest are hop-by-hop or server-specific.
_PASSED_HEADERS = frozenset(
    {"content-type", "content-length", "content-encoding", "cache-control", "retry-after"}
)
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_RELEASE_TIMEOUT_S = 5.0
#: Headers of a whole (non-streamed) answer the router sends itself or relays.
_WHOLE_HEADERS = frozenset({"content-type", "cache-control", "retry-after"})


class _Fallback(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ProxyResponse(Response):
    """A Starlette response only by type (so FastAPI passes it through); it sends its own messages."""

    def __init__(
        self,
        core: RouterCore,
        client: aiohttp.ClientSession,
        *,
        api: Api,
        path: str,
        raw_body: bytes,
        request_json: dict[str, Any],
        request_id: str,
        arrived: float,
    ) -> None:
        self.core = core
        self.client = client
        self.api = api
        self.path = path
        self.raw_body = raw_body
        self.request_json = request_json
        self.request_id = request_id
        self.arrived = arrived
        self.mode = core.settings.mode
        self._started = False  # response headers sent
        self._outcome = "success"
        # The prefill pod and the params it leased blocks under, until the decode leg succeeds.
        self._lease: tuple[Endpoint, dict[str, Any]] | None = None
        self.background: BackgroundTasks | None = None

    # ------------------------------------------------------------------ ASGI entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        run = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                if not run.done():  # the client went away (or the server is stopping): cancel the legs
                    run.cancel()
                    self._outcome = "cancelled"
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            except Exception:
                self._outcome = "internal_error"  # a bug: uvicorn answers 500 if nothing was sent yet
                raise
            finally:
                self.core.metrics.requests.labels(outcome=self._outcome, mode=self.mode).inc()
                if self._lease is not None and self._outcome != "success":
                    self._release_lease(*self._lease)

    async def _run(self, send: Send) -> None:
        try:
            await self.core.hold.until_available(self.core.needed_role)
        except PoolUnavailable as exc:
            await self._fail(
                send, 503, str(exc), errors.UNAVAILABLE, "unavailable", retry_after_s=exc.retry_after_s
            )
            return
        try:
            if self.mode == "aggregated":
                endpoint, _ = self.core.choose_first_leg(self.api, self.request_json)
                await self._relay([endpoint], self.raw_body, "direct", send)
                return
            try:
                params = await self._prefill_leg(send)
            except _Fallback as fb:
                await self._whole_to_decode(fb, send)
                return
            if params is None:  # the prefill pod refused the request; its answer was relayed
                return
            self._lease = (self._prefill_endpoint, params)
            try:
                # Only a decode pod of the prefill pod's KV-compatibility key can use its blocks.
                order = self.core.decode_order(self._prefill_endpoint.kv_key)
            except NoEndpoint as exc:
                if not exc.paired:
                    raise
                self._release_lease(*self._lease)  # nobody can pull it now
                self._lease = None
                await self._whole_to_decode(_Fallback("no_paired_decode", str(exc)), send)
                return
            decode_body = json.dumps({**self.request_json, "kv_transfer_params": params}).encode()
            await self._relay(order, decode_body, "decode", send)
        except NoEndpoint as exc:
            await self._fail(send, 503, str(exc), errors.UNAVAILABLE, "unavailable")

    async def _whole_to_decode(self, fb: _Fallback, send: Send) -> None:
        log.warning(
            "request %s: prefill leg failed (%s): %s; sending it whole to decode",
            self.request_id,
            fb.reason,
            fb,
        )
        self.core.metrics.fallbacks.labels(reason=fb.reason).inc()
        await self._relay(self.core.decode_order(), self.raw_body, "direct", send)

    # ------------------------------------------------------------------ legs

    def _leg_headers(self) -> dict[str, str]:
        return {"content-type": "application/json", REQUEST_ID_HEADER: self.request_id}

    async def _prefill_leg(self, send: Send) -> dict[str, Any] | None:
        """The producer's kv_transfer_params; None when its 4xx answer went to the client instead."""
        try:
            endpoint, _ = self.core.choose_first_leg(self.api, self.request_json)
        except NoEndpoint as exc:
            raise _Fallback("no_paired_prefill" if exc.paired else "no_prefill_pod", str(exc)) from None
        self._prefill_endpoint = endpoint
        leg = dict(self.request_json)
        leg.pop("stream_options", None)  # only valid with stream: true
        leg.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        settings = self.core.settings
        timeout = aiohttp.ClientTimeout(
            total=settings.prefill_timeout_s, sock_connect=settings.connect_timeout_s
        )
        started = time.perf_counter()
        self.core.in_flight[endpoint.key] += 1
        try:
            async with self.client.post(
                endpoint.url + self.path,
                data=json.dumps(leg).encode(),
                headers=self._leg_headers(),
                timeout=timeout,
            ) as response:
                status, headers, content = response.status, response.headers, await response.read()
        except _CONNECT_ERRORS as exc:
            raise _Fallback("connect", f"{endpoint.url}: {exc!r}") from None
        except TimeoutError as exc:
            raise _Fallback("timeout", f"{endpoint.url}: {exc!r}") from None
        except aiohttp.ClientError as exc:
            raise _Fallback("connect", f"{endpoint.url}: {exc!r}") from None
        finally:
            self.core.in_flight[endpoint.key] -= 1
            self.core.metrics.leg_seconds.labels(leg="prefill").observe(time.perf_counter() - started)
        if status >= 500:
            raise _Fallback("status", f"{endpoint.url} answered {status}")
        if status >= 400:
            self._outcome = "client_error"
            await self._send_whole(send, status, headers, content)
            return None
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise _Fallback("bad_response", f"{endpoint.url} returned no kv_transfer_params object")
        return params

    async def _relay(self, endpoints: list[Endpoint], content: bytes, leg: str, send: Send) -> None:
        """Send ``content`` to the first endpoint that accepts the connection and relay its answer."""
        settings = self.core.settings
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
        )
        refused: list[str] = []
        for endpoint in endpoints:
            started = time.perf_counter()
            self.core.in_flight[endpoint.key] += 1
            try:
                try:
                    response = await self.client.post(
                        endpoint.url + self.path, data=content, headers=self._leg_headers(), timeout=timeout
                    )
                except _CONNECT_ERRORS as exc:
                    refused.append(f"{endpoint.url}: {exc!r}")
                    continue
                except (aiohttp.ClientError, TimeoutError) as exc:
                    message = f"{leg} leg to {endpoint.url} failed: {exc!r}"
                    await self._fail(send, 502, message, errors.UPSTREAM, "upstream_error")
                    return
                if response.status == 503:
                    content_503 = await _read_and_release(response)
                    if content_503 is not None and _is_draining(content_503):
                        # Told to stop before the router saw its pod go: it took nothing; next pod.
                        refused.append(f"{endpoint.url}: draining")
                        continue
                    self._outcome = "upstream_error"
                    await self._send_whole(send, 503, response.headers, content_503 or b"")
                    return
                try:
                    await self._stream_back(response, send, endpoint)
                finally:
                    if response.content.is_eof():
                        response.release()  # whole answer read: the connection goes back to the pool
                    else:
                        response.close()  # cancelled or broken mid-answer: close the upstream stream
                return
            finally:
                self.core.in_flight[endpoint.key] -= 1
                self.core.metrics.leg_seconds.labels(leg=leg).observe(time.perf_counter() - started)
        message = f"{leg} leg: no pod accepted the connection ({'; '.join(refused)})"
        await self._fail(send, 503, message, errors.UNAVAILABLE, "unavailable")

    async def _stream_back(self, response: aiohttp.ClientResponse, send: Send, endpoint: Endpoint) -> None:
        status = response.status
        if status >= 500:
            self._outcome = "upstream_error"
        elif status >= 400:
            self._outcome = "client_error"
        await self._start(send, status, response.headers)
        try:
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._outcome = "upstream_error"
            log.warning("request %s: stream from %s broke: %r", self.request_id, endpoint.url, exc)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                frame = errors.sse_error_frame(f"upstream {endpoint.url} stream broke: {exc!r}")
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _release_lease(self, endpoint: Endpoint, params: dict[str, Any]) -> None:
        """The decode leg did not complete (client gone, no decode pod, decode refused or broke):
        ask the prefill pod to free the blocks it leased for it now, not at lease expiry. A
        consumer that did pull or release them already makes this a no-op."""
        task = asyncio.ensure_future(_post_release(self.client, endpoint, params, self.request_id))
        self.core.background.add(task)
        task.add_done_callback(self.core.background.discard)

    # ------------------------------------------------------------------ responses

    async def _start(self, send: Send, status: int, headers: Mapping[str, str]) -> None:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items() if k.lower() in _PASSED_HEADERS]
        raw.append((REQUEST_ID_HEADER.encode(), self.request_id.encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        self._started = True
        self.core.metrics.ttfb_seconds.observe(time.perf_counter() - self.arrived)

    async def _send_whole(self, send: Send, status: int, headers: Mapping[str, str], body: bytes) -> None:
        kept = {k: v for k, v in headers.items() if k.lower() in _WHOLE_HEADERS}
        kept["content-length"] = str(len(body))
        await self._start(send, status, kept)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _fail(
        self,
        send: Send,
        status: int,
        message: str,
        type_: str,
        outcome: str,
        *,
        retry_after_s: int | None = None,
    ) -> None:
        self._outcome = outcome
        if self._started:  # too late for a status: the stream just ends
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        headers = {"content-type": "application/json"}
        if retry_after_s is not None:
            headers["retry-after"] = str(retry_after_s)
        await self._send_whole(send, status, headers, errors.error_bytes(message, type_, code=status))


async def _post_release(
    client: aiohttp.ClientSession, endpoint: Endpoint, params: dict[str, Any], request_id: str
) -> None:
    url = endpoint.url + contract.PATH_KV_TRANSFER_RELEASE
    try:
        async with client.post(
            url,
            json={"kv_transfer_params": params},
            headers={REQUEST_ID_HEADER: request_id},
            timeout=aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S),
        ) as response:
            answer = await response.read()
        log.info("request %s: lease release on %s: %d %r", request_id, endpoint.url, response.status, answer)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("request %s: lease release on %s failed: %r", request_id, endpoint.url, exc)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _read_and_release(response: aiohttp.ClientResponse) -> bytes | None:
    try:
        return await response.read()
    except aiohttp.ClientError:
        return None
    finally:
        response.release()


def _is_draining(content: bytes) -> bool:
    """Whether a 503 body is an engine's refusal while it drains (nothing of the request ran)."""
    try:
        body = json.loads(content)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "draining"
