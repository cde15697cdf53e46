"""A closed-loop load generator for the router: `concurrency` clients, each sending one
completion after another; every answer is counted (status, error text) for the test to check."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadStats:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    by_status: Counter[int] = field(default_factory=Counter)


class LoadGenerator:
    """Runs in its own thread and event loop; `set_concurrency` changes the number of clients."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float = 120.0) -> None:
        self.url, self.body, self.timeout_s = url, body, timeout_s
        self._sent = 0
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._target = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def start(self, concurrency: int) -> LoadGenerator:
        self._target = concurrency
        self._thread.start()
        return self

    def set_concurrency(self, concurrency: int) -> None:
        self._target = concurrency

    def set_body(self, body: dict[str, Any]) -> None:
        """Requests sent from now on carry `body` (those in flight keep theirs)."""
        self.body = body

    def snapshot(self) -> tuple[int, list[str]]:
        with self._lock:
            return self.stats.ok, list(self.stats.failures)

    def stop(self) -> LoadStats:
        """Stop sending; requests already sent are waited for (and counted)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 30)
        return self.stats

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        while not self._stop.is_set():
            if index >= self._target:
                await asyncio.sleep(0.05)
                continue
            # Each request opens with its own tag, as different users' prompts do: identical
            # prompts would all be routed to the pod that already caches them (prefix routing),
            # so a newly added prefill pod would never be chosen.
            with self._lock:
                self._sent += 1
                tag = f"[request {self._sent}] "
            body = {**self.body, "prompt": tag + self.body["prompt"]}
            try:
                response = await client.post(self.url, json=body)
                status, text = response.status_code, response.text
                ok = status == 200 and bool(response.json()["choices"][0]["text"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                status, text, ok = 0, f"{type(exc).__name__}: {exc}", False
            with self._lock:
                self.stats.by_status[status] += 1
                if ok:
                    self.stats.ok += 1
                else:
                    self.stats.failures.append(f"{status}: {text[:300]}")

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(32)))
