"""Reading engine load: parse an engine's Prometheus text exposition, scrape many pods at once.

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
    M_KV_BLOCKS_TOTAL,
    M_KV_USAGE,
    M_PREEMPTIONS,
    M_REQUESTS_RUNNING,
    M_REQUESTS_WAITING,
    PATH_METRICS,
)

from .policy_types import EngineLoad, PodSample

MAX_BODY_BYTES = 4 * 1024 * 1024
_REQUIRED = frozenset({M_REQUESTS_WAITING, M_REQUESTS_RUNNING, M_KV_USAGE})
_OPTIONAL = frozenset({M_KV_BLOCKS_TOTAL, M_PREEMPTIONS})


class MetricsParseError(ValueError):
    """An engine's /metrics answer lacks a metric the autoscaler needs, or holds a bad value."""


def _is_sample_of(line: str, names: frozenset[str]) -> bool:
    """True for a sample line of exactly one of ``names`` (not a longer name sharing the prefix)."""
    for name in names:
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ", "\t"):
            return True
    return False


def _values_by_sample_name(text: str, wanted: frozenset[str]) -> dict[str, list[float]]:
    # An engine exposes dozens of histogram buckets the autoscaler never reads, and the parser is
    # pure Python: hand it only the sample lines it needs (HELP/TYPE are not needed for values).
    prefixes = tuple(wanted)
    lines = [ln for ln in text.splitlines() if ln.startswith(prefixes) and _is_sample_of(ln, wanted)]
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(float(sample.value))
    except ValueError as exc:  # the parser's own error for malformed lines
        raise MetricsParseError(f"not Prometheus text format: {exc}") from exc
    return values


def _checked(name: str, series: list[float]) -> list[float]:
    for v in series:
        if math.isnan(v) or v < 0:
            raise MetricsParseError(f"{name}: bad value {v}")
    return series


def _required_sum(values: dict[str, list[float]], name: str) -> float:
    if name not in values:
        raise MetricsParseError(f"{name}: missing from /metrics")
    return sum(_checked(name, values[name]))


def _optional_sum(values: dict[str, list[float]], name: str | None) -> float | None:
    if name is None or name not in values:
        return None
    return sum(_checked(name, values[name]))


def parse_engine_metrics(text: str, *, queued_tokens_metric: str | None = None) -> EngineLoad:
    """Load figures from one engine's /metrics text.

    Counts sum over label sets; the KV usage ratio takes the largest series (one engine exports
    one, but a fuller cache must never be averaged away). ``queued_tokens_metric`` names a gauge
    of queued prompt tokens when the engines export one.
    """
    wanted = _REQUIRED | _OPTIONAL | ({queued_tokens_metric} if queued_tokens_metric else set())
    values = _values_by_sample_name(text, frozenset(wanted))
    if M_KV_USAGE not in values:
        raise MetricsParseError(f"{M_KV_USAGE}: missing from /metrics")
    kv_usage = max(_checked(M_KV_USAGE, values[M_KV_USAGE]))
    if kv_usage > 1:
        raise MetricsParseError(f"{M_KV_USAGE}: {kv_usage} is not a ratio in 0..1")
    return EngineLoad(
        waiting=_required_sum(values, M_REQUESTS_WAITING),
        running=_required_sum(values, M_REQUESTS_RUNNING),
        kv_usage=kv_usage,
        queued_prompt_tokens=_optional_sum(values, queued_tokens_metric),
        kv_blocks=_optional_sum(values, M_KV_BLOCKS_TOTAL),
        preemptions_total=_optional_sum(values, M_PREEMPTIONS),
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
