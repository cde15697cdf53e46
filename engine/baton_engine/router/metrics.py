"""The router's own Prometheus metrics (names from the contract's router section)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from baton_engine import contract

_HOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _base(counter_name: str) -> str:
    return counter_name.removesuffix("_total")


class RouterMetrics:
    """One set per router app, in its own registry (several apps may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            _base(contract.M_ROUTER_REQUESTS), "Client requests by outcome", ["outcome", "mode"], registry=r
        )
        self.leg_seconds = Histogram(
            contract.M_ROUTER_LEG_SECONDS, "Upstream leg duration", ["leg"], buckets=_LEG_BUCKETS, registry=r
        )
        self.ttfb_seconds = Histogram(
            contract.M_ROUTER_TTFB_SECONDS,
            "Request arrival to first byte sent",
            buckets=_LEG_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            _base(contract.M_ROUTER_FALLBACKS),
            "Prefill-leg failures sent whole to decode",
            ["reason"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            _base(contract.M_ROUTER_PREFIX_HIT_TOKENS), "Cached prompt tokens on the chosen pods", registry=r
        )
        self.endpoints = Gauge(contract.M_ROUTER_ENDPOINTS, "Known endpoints", ["role"], registry=r)
        self.kv_events_next_seq = Gauge(
            contract.M_ROUTER_KV_EVENTS_NEXT_SEQ,
            "Sequence number of the next KV-event batch expected from each pod (all before it applied)",
            ["pod"],
            registry=r,
        )

        # Counted by the KV-event subscriber; the app points `source` at its stats.
        self.kv_events_counters = KVEventCounters(dict)
        r.register(self.kv_events_counters)

        self.held = Gauge(
            contract.M_ROUTER_HELD, "Requests waiting for a pod of a pool that has none", registry=r
        )
        self.held_total = Counter(
            _base(contract.M_ROUTER_HELD_TOTAL),
            "Requests that waited for a pod, by how the wait ended",
            ["outcome"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            contract.M_ROUTER_HOLD_SECONDS,
            "Seconds a held request waited until a pod was available",
            buckets=_HOLD_BUCKETS,
            registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _RejectCount(Protocol):
    rejected_batches: int


class KVEventCounters:
    """Per-pod KV-event counters, read from the subscriber's stats when scraped (the subscriber
    counts; this only exposes)."""

    def __init__(self, source: Callable[[], Mapping[str, _RejectCount]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            _base(contract.M_ROUTER_KV_EVENTS_REJECTED),
            "KV-event batches from each pod that did not decode (each drops that pod's index)",
            labels=["pod"],
        )
        for pod, stats in sorted(self.source().items()):
            rejected.add_metric([pod], stats.rejected_batches)
        yield rejected
