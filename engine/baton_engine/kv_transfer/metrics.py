"""KV-transfer metrics (names from `baton_engine.contract`).

Transfers run in the engine-core process while /metrics is served by the HTTP server process.
The transfer code records into a `TransferStats` (thread-safe, plain Python). Its cumulative
`totals()` travel with the engine's stats snapshots to the server, where a
`KVTransferCollector` renders the latest totals (counters and a histogram computed from
cumulative numbers never go backwards, and a lost snapshot loses nothing). `take()` gives the
change since the previous call, for tests and in-process callers.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from baton_engine import contract

TRANSFER_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
ROLES = ("consumer", "producer")  # consumer: PULL sent -> DONE acked; producer: serving one PULL


@dataclass
class TransferStatsDelta:
    """What happened since the previous `TransferStats.take()`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pull_seconds: list[float] = field(default_factory=list)
    serve_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    leases_expired: int = 0

    def is_empty(self) -> bool:
        return self == TransferStatsDelta()


@dataclass
class TransferTotals:
    """Cumulative counts since the engine started (plain data: crosses the process boundary)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    leases_expired: int = 0
    # role -> per-bucket counts (not cumulative; the last one is +Inf), sum, count
    bucket_counts: dict[str, list[int]] = field(
        default_factory=lambda: {role: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1) for role in ROLES}
    )
    seconds_sum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROLES, 0.0))

    def observe(self, role: str, seconds: float) -> None:
        self.bucket_counts[role][bisect.bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1
        self.seconds_sum[role] += seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TransferTotals:
        return cls(**raw)


class TransferStats:
    """Thread-safe recorder the producer and the consumer write into."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta = TransferStatsDelta()
        self._totals = TransferTotals()
        self.version = 0
        """Bumped on every record: lets an idle engine notice it has news for /metrics."""

    def sent(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._delta.bytes_sent += nbytes
            self._delta.serve_seconds.append(seconds)
            self._totals.bytes_sent += nbytes
            self._totals.observe("producer", seconds)
            self.version += 1

    def received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._delta.bytes_received += nbytes
            self._delta.pull_seconds.append(seconds)
            self._totals.bytes_received += nbytes
            self._totals.observe("consumer", seconds)
            self.version += 1

    def failed(self, reason: str) -> None:
        with self._lock:
            self._delta.failures[reason] = self._delta.failures.get(reason, 0) + 1
            self._totals.failures[reason] = self._totals.failures.get(reason, 0) + 1
            self.version += 1

    def lease_expired(self, count: int = 1) -> None:
        with self._lock:
            self._delta.leases_expired += count
            self._totals.leases_expired += count
            self.version += 1

    def take(self) -> TransferStatsDelta:
        with self._lock:
            delta, self._delta = self._delta, TransferStatsDelta()
            return delta

    def totals(self) -> TransferTotals:
        with self._lock:
            return TransferTotals.from_dict(self._totals.to_dict())


class KVTransferCollector(Collector):
    """Renders the latest `TransferTotals` as bytes, transfer time, failures, expired leases."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self._totals = TransferTotals()
        if registry is not None:
            registry.register(self)

    def update(self, totals: TransferTotals | dict[str, Any]) -> None:
        self._totals = totals if isinstance(totals, TransferTotals) else TransferTotals.from_dict(totals)

    def collect(self) -> Iterator[Metric]:
        t, m = self._totals, self.model_name
        transferred = CounterMetricFamily(
            contract.M_KV_TRANSFER_BYTES.removesuffix("_total"),
            "KV-cache bytes transferred between prefill and decode engines, by direction.",
            labels=["model_name", "direction"],
        )
        transferred.add_metric([m, "sent"], t.bytes_sent)
        transferred.add_metric([m, "received"], t.bytes_received)
        yield transferred
        seconds = HistogramMetricFamily(
            contract.M_KV_TRANSFER_SECONDS,
            "KV transfer time: consumer from PULL to DONE acknowledged; producer serving one PULL.",
            labels=["model_name", "role"],
        )
        for role in ROLES:
            running, buckets = 0, []
            for bound, count in zip(
                [*map(str, TRANSFER_SECONDS_BUCKETS), "+Inf"], t.bucket_counts[role], strict=True
            ):
                running += count
                buckets.append((bound, running))
            seconds.add_metric([m, role], buckets, t.seconds_sum[role])
        yield seconds
        failures = CounterMetricFamily(
            contract.M_KV_TRANSFER_FAILURES.removesuffix("_total"),
            "Failed KV pulls (and sends), by reason.",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(t.failures.items()):
            failures.add_metric([m, reason], count)
        yield failures
        expired = CounterMetricFamily(
            contract.M_KV_LEASES_EXPIRED.removesuffix("_total"),
            "Producer leases that expired before a consumer pulled them (blocks freed).",
            labels=["model_name"],
        )
        expired.add_metric([m], t.leases_expired)
        yield expired
