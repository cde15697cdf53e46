"""Each engine pod's load, scraped from its ``/metrics`` about once a second.

Only three gauges matter (queue depth, running requests, KV-cache usage), under Baton's names or
vLLM's (a vLLM pod is read like a Baton one), so the Prometheus text is scanned line by line for
those names instead of parsed in full. A pod whose metrics cannot be
read has unknown load (the policy ranks it after pods with known load) and counts as unreachable
when the connection itself failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from baton_engine import contract
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, EventKind

log = logging.getLogger(__name__)

_FIGURES = ("waiting", "running", "kv_usage")
#: Baton's and vLLM's name of each figure: Baton pods export both, vLLM pods only vLLM's.
_WANTED = tuple(name for figure in _FIGURES for name in contract.LOAD_METRICS[figure])


@dataclass(frozen=True)
class Load:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    reachable: bool = True  # False once a scrape could not connect; True again on success
    scraped_at: float = 0.0  # time.monotonic() of the last attempt (0: never)


UNKNOWN = Load()


def parse_load(text: str, names: Iterable[str] = _WANTED) -> dict[str, float]:
    """Sum of each wanted metric's samples (over label sets) in Prometheus text exposition format."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if 0 <= at < cut:
                cut = at
        name = line[:cut]
        if name not in wanted:
            continue
        rest = line[cut:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def load_figures(values: dict[str, float]) -> dict[str, float | None]:
    """waiting, running and kv_usage from parsed totals: Baton's name where present, else vLLM's
    (a Baton pod exports both with one value; they are never added)."""
    figures: dict[str, float | None] = {}
    for figure in _FIGURES:
        baton, vllm = contract.LOAD_METRICS[figure]
        figures[figure] = values[baton] if baton in values else values.get(vllm)
    return figures


class LoadTracker:
    """Scrapes every endpoint in the registry; keeps the latest ``Load`` per endpoint key."""

    def __init__(
        self,
        registry: EndpointRegistry,
        client: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        concurrency: int = 16,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or concurrency <= 0:
            raise ValueError("load tracker: interval, timeout and concurrency must be positive")
        self._registry = registry
        self._client = client
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._limit = asyncio.Semaphore(concurrency)
        self._loads: dict[str, Load] = {}
        self._wake = asyncio.Event()
        registry.subscribe(self._on_endpoint)

    def _on_endpoint(self, kind: EventKind, endpoint: Endpoint) -> None:
        if kind == "removed":
            self._loads.pop(endpoint.key, None)
        else:
            self._wake.set()  # scrape a new pod now rather than up to a second later

    def get(self, key: str) -> Load:
        return self._loads.get(key, UNKNOWN)

    async def scrape_once(self) -> None:
        endpoints = self._registry.all()
        await asyncio.gather(*(self._scrape(e) for e in endpoints))

    async def _scrape(self, endpoint: Endpoint) -> None:
        async with self._limit:
            now = time.monotonic()
            try:
                async with self._client.get(
                    endpoint.url + contract.PATH_METRICS, timeout=self._timeout
                ) as response:
                    status = response.status
                    text = await response.text() if status == 200 else ""
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                log.debug("scrape %s: cannot connect: %s", endpoint.url, exc)
                load = Load(reachable=False, scraped_at=now)
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
                log.debug("scrape %s: %s", endpoint.url, exc)
                load = Load(scraped_at=now)
            else:
                if status != 200:
                    load = Load(scraped_at=now)
                else:
                    figures = load_figures(parse_load(text))
                    load = Load(
                        waiting=figures["waiting"],
                        running=figures["running"],
                        kv_usage=figures["kv_usage"],
                        scraped_at=now,
                    )
        if self._registry.get(endpoint.key) is not None:  # not removed while we waited
            self._loads[endpoint.key] = load

    async def run(self) -> None:
        """Scrape forever, one round per interval (a round never overlaps the next)."""
        while True:
            started = time.monotonic()
            self._wake.clear()
            try:
                await self.scrape_once()
            except Exception:  # a bug here must not stop load tracking for good
                log.exception("load scrape round failed")
            delay = max(0.0, self._interval_s - (time.monotonic() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
