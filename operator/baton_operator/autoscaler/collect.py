"""One tick's observations: engine Pods from the API server, scraped, into the policy's input."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from .metrics import scrape_pods, scrape_routers
from .pods import router_targets, view_pods
from .policy_types import Observations


async def collect(
    pods: Iterable[Mapping[str, Any]],
    replicas: Mapping[str, int],
    *,
    client: httpx.AsyncClient | None = None,
    timeout_s: float = 2.0,
    concurrency: int = 16,
    queued_tokens_metric: str | None = None,
    clock: Callable[[], float] = time.time,
    routers: bool = False,
) -> Observations:
    """Scrape the ready engine pods (the policy reads no others) and note the pending ones; with
    `routers` (scale to zero) also the router pods' demand.

    ``replicas``: each role Deployment's ``spec.replicas`` as it is now.
    """
    pods = list(pods)
    view = view_pods(pods)
    samples = await scrape_pods(
        [t for t in view.targets if t.ready],
        client=client,
        timeout_s=timeout_s,
        concurrency=concurrency,
        queued_tokens_metric=queued_tokens_metric,
        clock=clock,
    )
    demand = None
    if routers:
        own = client is None
        http = client if client is not None else httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        try:
            demand = await scrape_routers(router_targets(pods), client=http, timeout_s=timeout_s)
        finally:
            if own:
                await http.aclose()
    return Observations(replicas=dict(replicas), samples=tuple(samples), pending=view.pending, demand=demand)
