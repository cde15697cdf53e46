"""Run one engine pod: start uvicorn at once (``/health`` answers while loading), load the
tokenizer and start the engine-core process in the background, then serve.

SIGTERM/SIGINT start a drain: ``/ready`` turns 503 at once, new requests get 503, in-flight
requests finish (up to the grace period), then the server stops, the core process is shut
down, and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from baton_engine.config import EngineConfig
from baton_engine.entrypoints.cpu_layout import host_cpu_layout
from baton_engine.model.loader.tokenizer_loading import NoTokenizerError, load_tokenizer
from baton_engine.server.app import build_app
from baton_engine.server.engine_client import EngineClient
from baton_engine.server.metrics import EngineMetrics
from baton_engine.server.state import ServerState, max_token_chars

log = logging.getLogger("baton_engine.server")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` installs draining handlers instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def _log_started_message(self, listeners: Any) -> None:
        """Silenced: uvicorn's "running on" would come before the model is loaded; `_load`
        says where the server serves once it is ready."""


async def _load(state: ServerState, server: _Server, on_fatal: Callable[[str], None]) -> None:
    config = state.config
    started = time.monotonic()
    try:
        log.info("loading the tokenizer of %s", config.model)
        try:
            state.tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
        except NoTokenizerError as exc:  # a model without tokenizer files still serves token-id prompts
            log.warning("%s; only token-id prompts will work", exc)
        if state.tokenizer is not None:
            state.max_token_chars = await asyncio.to_thread(max_token_chars, state.tokenizer)
        log.info("starting the engine core (it loads the weights)")
        client = EngineClient(config, on_stats=state.metrics.update, on_fatal=on_fatal)
        state.client = client
        layout = None
        if config.device.split(":")[0] == "cpu":
            # tensor-parallel ranks share the core's CPUs: pinning it to some would crowd them
            bind = config.cpu_bind if config.tensor_parallel_size == 1 else "none"
            layout = host_cpu_layout(config.cpu_threads, bind)
        await client.start(layout=layout)
        if layout is not None and layout.server_cpus is not None:
            os.sched_setaffinity(0, layout.server_cpus)
            log.info("CPU layout: server on %s, engine core on %s with %d threads",
                     layout.server_cpus, layout.core_cpus, layout.core_threads)  # fmt: skip
        state.engine_started(client)
        info = client.info
        log.info(
            "ready in %.1f s: serving %s on http://%s:%d (%d KV blocks, max_model_len %d, core pid %s)",
            time.monotonic() - started, state.model_name, config.host, config.port, info["num_kv_blocks"],
            state.max_model_len, info["pid"],
        )  # fmt: skip
    except Exception as exc:
        state.load_error = str(exc)
        log.error("loading failed: %s", state.load_error)
        server.should_exit = True


def _leases_held(state: ServerState) -> int:
    return 0 if state.client is None else state.client.stats.kv_leases_held


async def _drain(state: ServerState, server: _Server, grace_seconds: float) -> None:
    """Wait for in-flight requests, then for producer leases (a decode pod may still pull the
    KV of a request this prefill pod already answered), within the grace period."""
    deadline = time.monotonic() + grace_seconds
    while (state.in_flight > 0 or _leases_held(state) > 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight or _leases_held(state):
        log.warning(
            "grace period over with %d requests in flight and %d KV leases held; stopping anyway",
            state.in_flight,
            _leases_held(state),
        )
    else:
        log.info("drained; stopping")
    server.should_exit = True


async def _serve(config: EngineConfig, grace_seconds: float, log_level: str) -> int:
    metrics = EngineMetrics("", names=config.metric_names, block_size=config.block_size)
    metrics.enable_prefix_caching = config.enable_prefix_caching
    state = ServerState(config=config, metrics=metrics)  # labelled once the model is known
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = _Server(uv_config)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        if state.draining:
            log.warning("second signal %d: stopping now", signum)
            server.force_exit = True
            server.should_exit = True
            return
        log.info(
            "signal %d: draining (%d requests in flight, grace %g s)", signum, state.in_flight, grace_seconds
        )
        state.draining = True
        tasks.append(asyncio.create_task(_drain(state, server, grace_seconds)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        log.error("engine core stopped: %s; exiting with code 1", reason)
        fatal.append(reason)
        server.should_exit = True

    tasks.append(asyncio.create_task(_load(state, server, on_fatal)))
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if state.client is not None:
            await state.client.close()
        state.preprocessor.shutdown(wait=False, cancel_futures=True)
    return 1 if state.load_error or fatal else 0


def serve(config: EngineConfig, *, grace_seconds: float = 30.0, log_level: str = "info") -> int:
    """Serve until drained; the process exit code (1 when loading failed)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        return runner.run(_serve(config, grace_seconds, log_level))


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed (the engine extra installs it), else asyncio's.

    The server process shares the machine's cores with the engine core: every streamed token
    passes through the loop (the core's output socket, the request's queue, the SSE write), and
    uvloop does that in C. uvicorn picks uvloop only for a loop it creates itself; this one
    runs uvicorn inside `_serve`'s loop.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop
