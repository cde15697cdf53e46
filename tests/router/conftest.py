from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from baton_engine import contract
from baton_engine.router.app import create_app
from baton_engine.router.core import RouterCore
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, static_endpoint
from baton_engine.router.kv_index import KVEventIndex
from baton_engine.router.prefix import PrefixScorer
from baton_engine.router.settings import RouterSettings
from baton_support.wait import wait_for
from tests.router.fake_engine import FakeEngine
from tests.router.servers import ServerThread, stop_all


class ThreadedDiscovery:
    """A discovery source the test thread drives: `add`/`remove` change the router's registry on
    the router's own event loop (as a Pod watch does) and return once applied."""

    def __init__(self) -> None:
        self._commands: queue.Queue[tuple[str, Endpoint | str, threading.Event]] = queue.Queue()

    async def __call__(self, registry: EndpointRegistry) -> None:
        while True:
            try:
                kind, what, applied = await asyncio.to_thread(self._commands.get, True, 0.1)
            except queue.Empty:
                continue
            if kind == "add":
                assert isinstance(what, Endpoint)
                registry.upsert(what)
            else:
                assert isinstance(what, str)
                registry.remove(what)
            applied.set()

    def _send(self, kind: str, what: Endpoint | str) -> None:
        applied = threading.Event()
        self._commands.put((kind, what, applied))
        assert applied.wait(30), f"discovery did not apply {kind} {what}"

    def add(self, endpoint: Endpoint) -> None:
        self._send("add", endpoint)

    def remove(self, key: str) -> None:
        self._send("remove", key)


class RunningRouter:
    def __init__(self, server: ServerThread, app: Any, discovery: ThreadedDiscovery) -> None:
        self.server = server
        self.url = server.url
        self.app = app
        self.discovery = discovery

    @property
    def core(self) -> RouterCore:
        return self.app.state.router_state["core"]

    def wait_scraped(self) -> None:
        """Until every endpoint has been scraped at least once."""
        wait_for(
            lambda: all(self.core.loads.get(e.key).scraped_at > 0 for e in self.core.registry.all()),
            message="first load scrape of every endpoint",
        )


@pytest.fixture
def start_engine() -> Iterator[Callable[..., tuple[FakeEngine, str]]]:
    servers: list[ServerThread] = []

    def start(name: str, **behaviour: Any) -> tuple[FakeEngine, str]:
        engine = FakeEngine(name, **behaviour)
        server = ServerThread(engine).start()
        servers.append(server)
        return engine, server.url

    yield start
    stop_all(servers)


@pytest.fixture
def start_router() -> Iterator[Callable[..., RunningRouter]]:
    servers: list[ServerThread] = []

    def start(
        *,
        prefill: list[str] = (),  # type: ignore[assignment]
        decode: list[str] = (),  # type: ignore[assignment]
        engine: list[str] = (),  # type: ignore[assignment]
        endpoints: list[Endpoint] = (),  # type: ignore[assignment]
        scorer: PrefixScorer | None = None,
        kv_index: KVEventIndex | None = None,
        **settings: Any,
    ) -> RunningRouter:
        registry = EndpointRegistry()
        for endpoint in endpoints:
            registry.upsert(endpoint)
        for role, urls in (
            (contract.ROLE_PREFILL, prefill),
            (contract.ROLE_DECODE, decode),
            (contract.ROLE_AGGREGATED, engine),
        ):
            for url in urls:
                registry.upsert(static_endpoint(role, url))
        # The fake engines are threads of this process: on a loaded machine a scrape can outlast
        # the 0.5 s default, and a timed-out scrape makes a pod's load unknown (ranked last),
        # which would change where requests go. Dead pods are refused at once regardless.
        settings.setdefault("scrape_timeout_s", 10.0)
        discovery = ThreadedDiscovery()
        app = create_app(
            RouterSettings(**settings), registry, scorer=scorer, kv_index=kv_index, discovery=[discovery]
        )
        server = ServerThread(app, lifespan="on").start()
        servers.append(server)
        return RunningRouter(server, app, discovery)

    yield start
    stop_all(servers)
