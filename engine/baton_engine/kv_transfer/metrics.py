"""KV-transfer metrics (names from `baton_engine.contract`).

Transfers run in the engine-core process while /metrics is served by the HTTP server process, so
the transfer code records into a `TransferStats` accumulator (thread-safe, plain Python) whose
deltas travel with the engine's stats snapshots; `KVTransferMetrics.apply` turns a delta into
prometheus updates. In a single process `KVTransferMetrics.record` does both at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from baton_engine import contract

TRANSFER_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass
class TransferStatsDelta:
    """What happened since the previous `TransferStats.take()`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pull_seconds: list[float] = field(default_factory=list)  # consumer: PULL sent -> DONE acked
    serve_seconds: list[float] = field(default_factory=list)  # producer: PULL read -> last chunk sent
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    leases_expired: int = 0

    def is_empty(self) -> bool:
        return self == TransferStatsDelta()


class TransferStats:
    """Thread-safe accumulator the producer and consumer record into."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta = TransferStatsDelta()

    def sent(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._delta.bytes_sent += nbytes
            self._delta.serve_seconds.append(seconds)

    def received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._delta.bytes_received += nbytes
            self._delta.pull_seconds.append(seconds)

    def failed(self, reason: str) -> None:
        with self._lock:
            self._delta.failures[reason] = self._delta.failures.get(reason, 0) + 1

    def lease_expired(self, count: int = 1) -> None:
        with self._lock:
            self._delta.leases_expired += count

    def take(self) -> TransferStatsDelta:
        with self._lock:
            delta, self._delta = self._delta, TransferStatsDelta()
            return delta


class KVTransferMetrics:
    """The prometheus side: bytes, transfer time, failures by reason, expired leases."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.bytes = Counter(
            contract.M_KV_TRANSFER_BYTES.removesuffix("_total"),
            "KV-cache bytes transferred between prefill and decode engines, by direction.",
            ["model_name", "direction"],
            registry=r,
        )
        self.seconds = Histogram(
            contract.M_KV_TRANSFER_SECONDS,
            "KV transfer time: consumer from PULL to DONE acknowledged; producer serving one PULL.",
            ["model_name", "role"],
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            contract.M_KV_TRANSFER_FAILURES.removesuffix("_total"),
            "Failed KV pulls, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.leases_expired = Counter(
            contract.M_KV_LEASES_EXPIRED.removesuffix("_total"),
            "Producer leases that expired before a consumer pulled them (blocks freed).",
            ["model_name"],
            registry=r,
        )

    def apply(self, delta: TransferStatsDelta) -> None:
        m = self.model_name
        if delta.bytes_sent:
            self.bytes.labels(m, "sent").inc(delta.bytes_sent)
        if delta.bytes_received:
            self.bytes.labels(m, "received").inc(delta.bytes_received)
        for seconds in delta.pull_seconds:
            self.seconds.labels(m, "consumer").observe(seconds)
        for seconds in delta.serve_seconds:
            self.seconds.labels(m, "producer").observe(seconds)
        for reason, count in delta.failures.items():
            self.failures.labels(m, reason).inc(count)
        if delta.leases_expired:
            self.leases_expired.labels(m).inc(delta.leases_expired)
