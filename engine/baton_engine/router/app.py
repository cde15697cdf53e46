"""The router's HTTP API: OpenAI-compatible routes, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton_engine.router import errors
from baton_engine.router.core import RouterCore
from baton_engine.router.endpoints import EndpointRegistry
from baton_engine.router.kv_index import KVEventIndex
from baton_engine.router.load import LoadTracker
from baton_engine.router.metrics import RouterMetrics
from baton_engine.router.prefix import Api, PrefixScorer
from baton_engine.router.proxy import REQUEST_ID_HEADER, ProxyResponse
from baton_engine.router.settings import RouterSettings

log = logging.getLogger(__name__)

#: A discovery source: runs until cancelled, keeping the registry current.
DiscoveryTask = Callable[[EndpointRegistry], Coroutine[Any, Any, None]]

_MAX_REQUEST_ID = 200


def _error(status: int, message: str, type_: str, *, param: str | None = None) -> JSONResponse:
    return JSONResponse(errors.error_body(message, type_, param=param, code=status), status_code=status)


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "").strip()
    if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
        return given
    return f"baton-{uuid.uuid4().hex}"


def create_app(
    settings: RouterSettings,
    registry: EndpointRegistry,
    *,
    discovery: list[DiscoveryTask] | None = None,
    scorer: PrefixScorer | None = None,
    kv_index: KVEventIndex | None = None,
) -> FastAPI:
    """The router app. ``discovery`` tasks run for the app's lifetime and fill ``registry``;
    ``kv_index`` (if given, usually also ``scorer.index``) follows the registry's pods until shutdown.
    """
    metrics = RouterMetrics()
    if kv_index is not None:
        metrics.kv_events_counters.source = kv_index.stats
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # keep-alive below uvicorn's 5 s: never reuse a socket the pod is about to close
        connector = aiohttp.TCPConnector(
            limit=settings.max_connections, limit_per_host=0, keepalive_timeout=2.0
        )
        scrape_connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=2.0)
        async with (
            aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            ) as client,
            aiohttp.ClientSession(connector=scrape_connector) as scrape_client,
        ):
            loads = LoadTracker(
                registry,
                scrape_client,
                interval_s=settings.scrape_interval_s,
                timeout_s=settings.scrape_timeout_s,
                concurrency=settings.scrape_concurrency,
            )
            state["client"] = client
            state["core"] = RouterCore(settings, registry, loads, scorer or PrefixScorer(), metrics)
            if kv_index is not None:
                kv_index.attach(registry)
            tasks = [asyncio.create_task(loads.run(), name="baton-router-load")]
            tasks += [
                asyncio.create_task(d(registry), name="baton-router-discovery") for d in discovery or []
            ]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                if kv_index is not None:
                    await asyncio.to_thread(kv_index.close)

    app = FastAPI(title="baton-router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = errors.INVALID_REQUEST if exc.status_code < 500 else errors.UPSTREAM
        return _error(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, str(exc), errors.INVALID_REQUEST)

    def unauthorized(request: Request) -> JSONResponse | None:
        if settings.api_key is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            return None
        metrics.requests.labels(outcome="unauthorized", mode=settings.mode).inc()
        message = (
            "Incorrect API key provided."
            if header
            else "Missing API key: send 'Authorization: Bearer <key>'."
        )
        # as OpenAI answers a bad key: 401, invalid_request_error, code invalid_api_key
        body = errors.error_body(message, errors.INVALID_REQUEST, code="invalid_api_key")
        return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})

    async def proxy(request: Request, api: Api, path: str) -> Response:
        arrived = time.perf_counter()
        denied = unauthorized(request)
        if denied is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            metrics.requests.labels(outcome="client_error", mode=settings.mode).inc()
            return _error(400, f"request body: not valid JSON ({exc})", errors.INVALID_REQUEST)
        if not isinstance(body, dict):
            metrics.requests.labels(outcome="client_error", mode=settings.mode).inc()
            return _error(400, "request body: must be a JSON object", errors.INVALID_REQUEST)
        if "kv_transfer_params" in body:
            # only the router may start a KV transfer (a client could otherwise pin producer blocks
            # under leases, or replay another request's params); the legs get the router's own
            body.pop("kv_transfer_params")
            raw = json.dumps(body).encode()
        return ProxyResponse(
            state["core"],
            state["client"],
            api=api,
            path=path,
            raw_body=raw,
            request_json=body,
            request_id=_request_id(request),
            arrived=arrived,
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await proxy(request, "completions", "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "chat", "/v1/chat/completions")

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        core: RouterCore = state["core"]
        client: aiohttp.ClientSession = state["client"]
        endpoints = [e for role in settings.roles for e in core.registry.by_role(role)]

        async def fetch(url: str) -> list[dict[str, Any]]:
            timeout = aiohttp.ClientTimeout(total=settings.scrape_timeout_s * 4)
            try:
                async with client.get(url + "/v1/models", timeout=timeout) as response:
                    data = (
                        (await response.json(content_type=None)).get("data")
                        if response.status == 200
                        else None
                    )
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                return []
            return [m for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []

        merged: dict[str, dict[str, Any]] = {}
        for found in await asyncio.gather(*(fetch(e.url) for e in endpoints)):
            for model in found:
                merged.setdefault(str(model["id"]), model)
        if not merged and settings.model:
            merged[settings.model] = {
                "id": settings.model,
                "object": "model",
                "created": 0,
                "owned_by": "baton",
            }
        if not merged:
            return _error(503, "no upstream answered /v1/models", errors.UNAVAILABLE)
        return JSONResponse({"object": "list", "data": [merged[k] for k in sorted(merged)]})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", response_model=None)
    async def ready() -> Response:
        core: RouterCore = state["core"]
        counts = core.ready_roles()
        # A pool with no pod at all is no reason to leave the Service while requests can be held
        # (scaled to zero: the held requests are what wakes it); pods that exist and cannot be
        # reached are.
        missing = [
            role
            for role, n in counts.items()
            if n == 0 and (core.registry.by_role(role) or settings.hold_queue == 0)
        ]
        if missing:
            return _error(503, f"not ready: no reachable {' or '.join(missing)} pod", errors.UNAVAILABLE)
        body: dict[str, object] = {"status": "ready", "pods": counts}
        if kv_index is not None:
            body["kv_events"] = kv_index.health()
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if kv_index is not None:
            _export_kv_event_progress(kv_index, metrics)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.metrics = metrics
    app.state.registry = registry
    app.state.router_state = state
    return app


def _export_kv_event_progress(kv_index: KVEventIndex, metrics: RouterMetrics) -> None:
    gauge = metrics.kv_events_next_seq
    gauge.clear()
    for pod, stats in kv_index.stats().items():
        if stats.next_seq is not None:
            gauge.labels(pod=pod).set(stats.next_seq)
