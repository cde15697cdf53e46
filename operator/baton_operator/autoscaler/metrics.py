"""Reading engine load: parse an engine's Prometheus text exposition, scrape many pods at once.

Baton's engines export each figure under Baton's name and vLLM's (`contract.LOAD_METRICS`); a
vLLM pod exports only vLLM's. Either naming is read (Baton's first; the two are never summed).
A pod that cannot be read (refused, timed out, HTTP error, unparsable or incomplete answer)
yields a sample with ``load=None`` and the error: unknown, never zero load.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton_engine.contract import (
    LOAD_METRICS,
    M_KV_BLOCKS_TOTAL,
    M_ROUTER_HELD,
    M_ROUTER_REQUESTS,
    PATH_METRICS,
    VM_CACHE_CONFIG,
)

from .policy_types import EngineLoad, PodSample, RouterDemand

MAX_BODY_BYTES = 4 * 1024 * 1024
_WANTED = frozenset(name for pair in LOAD_METRICS.values() for name in pair) | {
    M_KV_BLOCKS_TOTAL,
    VM_CACHE_CONFIG,
}
#: vLLM's cache_config_info label holding the pool size.
_NUM_BLOCKS_LABEL = "num_gpu_blocks"


class MetricsParseError(ValueError):
    """An engine's /metrics answer lacks a metric the autoscaler needs, or holds a bad value."""


def _is_sample_of(line: str, names: frozenset[str]) -> bool:
    """True for a sample line of exactly one of ``names`` (not a longer name sharing the prefix)."""
    for name in names:
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ", "\t"):
            return True
    return False


def _samples_by_name(text: str, wanted: frozenset[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    # An engine exposes dozens of histogram buckets the autoscaler never reads, and the parser is
    # pure Python: hand it only the sample lines it needs (HELP/TYPE are not needed for values).
    prefixes = tuple(wanted)
    lines = [ln for ln in text.splitlines() if ln.startswith(prefixes) and _is_sample_of(ln, wanted)]
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except ValueError as exc:  # the parser's own error for malformed lines
        raise MetricsParseError(f"not Prometheus text format: {exc}") from exc
    return samples


def _checked(name: str, series: list[float]) -> list[float]:
    for v in series:
        if math.isnan(v) or v < 0:
            raise MetricsParseError(f"{name}: bad value {v}")
    return series


def _series(
    samples: dict[str, list[tuple[dict[str, str], float]]], figure: str, required: bool
) -> tuple[str, list[float]] | None:
    """(name read, values) of one figure under the first naming present."""
    for name in LOAD_METRICS[figure]:
        if name in samples:
            return name, _checked(name, [v for _, v in samples[name]])
    if required:
        baton, vllm = LOAD_METRICS[figure]
        raise MetricsParseError(f"{baton}: missing from /metrics (and {vllm})")
    return None


def _kv_blocks(samples: dict[str, list[tuple[dict[str, str], float]]]) -> float | None:
    if M_KV_BLOCKS_TOTAL in samples:
        return sum(_checked(M_KV_BLOCKS_TOTAL, [v for _, v in samples[M_KV_BLOCKS_TOTAL]]))
    sizes = [labels.get(_NUM_BLOCKS_LABEL) for labels, _ in samples.get(VM_CACHE_CONFIG, [])]
    try:
        blocks = [float(size) for size in sizes if size not in (None, "", "None")]
    except ValueError as exc:
        raise MetricsParseError(f"{VM_CACHE_CONFIG}: {_NUM_BLOCKS_LABEL} is not a number") from exc
    return sum(_checked(VM_CACHE_CONFIG, blocks)) if blocks else None


def parse_engine_metrics(text: str, *, queued_tokens_metric: str | None = None) -> EngineLoad:
    """Load figures from one engine's /metrics text (Baton's or vLLM's names).

    Counts sum over label sets; the KV usage ratio takes the largest series (one engine exports
    one, but a fuller cache must never be averaged away). ``queued_tokens_metric`` names a gauge
    of queued prompt tokens when the engines export one.
    """
    wanted = _WANTED | ({queued_tokens_metric} if queued_tokens_metric else set())
    samples = _samples_by_name(text, frozenset(wanted))
    kv = _series(samples, "kv_usage", required=True)
    assert kv is not None
    kv_name, kv_values = kv
    kv_usage = max(kv_values)
    if kv_usage > 1:
        raise MetricsParseError(f"{kv_name}: {kv_usage} is not a ratio in 0..1")
    waiting = _series(samples, "waiting", required=True)
    running = _series(samples, "running", required=True)
    assert waiting is not None and running is not None
    preemptions = _series(samples, "preemptions", required=False)
    queued = None
    if queued_tokens_metric is not None and queued_tokens_metric in samples:
        queued = sum(_checked(queued_tokens_metric, [v for _, v in samples[queued_tokens_metric]]))
    return EngineLoad(
        waiting=sum(waiting[1]),
        running=sum(running[1]),
        kv_usage=kv_usage,
        queued_prompt_tokens=queued,
        kv_blocks=_kv_blocks(samples),
        preemptions_total=None if preemptions is None else sum(preemptions[1]),
    )


def metrics_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}{PATH_METRICS}"


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    role: str
    url: str
    ready: bool = True


async def _fetch(client: httpx.AsyncClient, url: str) -> str:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise MetricsParseError(f"HTTP {response.status_code}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise MetricsParseError(f"answer larger than {MAX_BODY_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


def _describe(exc: BaseException) -> str:
    # Connection errors can arrive wrapped in an ExceptionGroup (a TaskGroup inside the
    # transport): name the first real cause.
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _scrape_one(
    client: httpx.AsyncClient,
    target: ScrapeTarget,
    gate: asyncio.Semaphore,
    timeout_s: float,
    queued_tokens_metric: str | None,
    clock: Callable[[], float],
) -> PodSample:
    async with gate:
        try:
            # httpx's timeout bounds each read; this bounds the whole request (slow trickles too).
            async with asyncio.timeout(timeout_s):
                text = await _fetch(client, target.url)
            load = parse_engine_metrics(text, queued_tokens_metric=queued_tokens_metric)
        except TimeoutError:
            error = f"timeout after {timeout_s:g}s"
        except httpx.TimeoutException:
            error = f"timeout after {timeout_s:g}s"
        except MetricsParseError as exc:
            error = str(exc)
        except Exception as exc:  # one bad pod must not blank the whole tick
            error = _describe(exc)
        else:
            return PodSample(target.pod, target.role, target.ready, clock(), load)
    return PodSample(target.pod, target.role, target.ready, clock(), None, error)


async def scrape_pods(
    targets: Iterable[ScrapeTarget],
    *,
    client: httpx.AsyncClient | None = None,
    timeout_s: float = 2.0,
    concurrency: int = 16,
    queued_tokens_metric: str | None = None,
    clock: Callable[[], float] = time.time,
) -> list[PodSample]:
    """Scrape every target, at most ``concurrency`` at a time; one sample per target, in order."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s:g}")
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    todo: Sequence[ScrapeTarget] = list(targets)
    gate = asyncio.Semaphore(concurrency)
    own = client is None
    http = client if client is not None else httpx.AsyncClient(timeout=timeout_s, trust_env=False)
    try:
        return list(
            await asyncio.gather(
                *(_scrape_one(http, t, gate, timeout_s, queued_tokens_metric, clock) for t in todo)
            )
        )
    finally:
        if own:
            await http.aclose()


def parse_router_demand(text: str) -> RouterDemand:
    """Held requests and requests seen (every outcome) from one router's /metrics text. The
    request counter has no sample before the first request: none seen yet."""
    samples = _samples_by_name(text, frozenset({M_ROUTER_HELD, M_ROUTER_REQUESTS}))
    if M_ROUTER_HELD not in samples:
        raise MetricsParseError(f"{M_ROUTER_HELD}: missing from /metrics")
    held = _checked(M_ROUTER_HELD, [v for _, v in samples[M_ROUTER_HELD]])
    requests = _checked(M_ROUTER_REQUESTS, [v for _, v in samples.get(M_ROUTER_REQUESTS, [])])
    return RouterDemand(held=sum(held), requests=sum(requests))


async def scrape_routers(
    targets: Sequence[ScrapeTarget], *, client: httpx.AsyncClient, timeout_s: float = 2.0
) -> RouterDemand | None:
    """The demand summed over the routers that answered; None when none did (unknown demand:
    never read as no demand)."""

    async def one(target: ScrapeTarget) -> RouterDemand | None:
        try:
            async with asyncio.timeout(timeout_s):
                return parse_router_demand(await _fetch(client, target.url))
        except (TimeoutError, httpx.HTTPError, MetricsParseError, OSError):
            return None

    found = [d for d in await asyncio.gather(*(one(t) for t in targets)) if d is not None]
    if not found:
        return None
    return RouterDemand(held=sum(d.held for d in found), requests=sum(d.requests for d in found))
