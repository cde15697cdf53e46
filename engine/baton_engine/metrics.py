"""Prometheus metrics of one engine pod (names from `baton_engine.contract`).

Gauges and counters mirror the engine core's `EngineStats` snapshots (counters advance by the
difference between snapshots, so they never go backwards); the latency histograms are observed
by the server process, which sees each request's tokens when the client does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton_engine import contract
from baton_engine.engine_stats import EngineStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


def _counter_name(full: str) -> str:
    """prometheus_client appends `_total` itself; the contract names carry it."""
    return full.removesuffix("_total")


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(_counter_name(name), doc, labels, registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.waiting = gauge(contract.M_REQUESTS_WAITING, "Requests waiting to be scheduled (queue depth).")
        self.running = gauge(contract.M_REQUESTS_RUNNING, "Requests in the running batch.")
        self.kv_usage = gauge(contract.M_KV_USAGE, "Fraction of KV-cache blocks in use (0..1).")
        self.kv_blocks = gauge(contract.M_KV_BLOCKS_TOTAL, "KV-cache blocks in the pool.")
        self.prefix_queries = counter(
            contract.M_PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(contract.M_PREFIX_HITS, "Prompt tokens served from the prefix cache.")
        self.preemptions = counter(contract.M_PREEMPTIONS, "Requests preempted (recomputed later).")
        self.prompt_tokens = counter(contract.M_PROMPT_TOKENS, "Prompt tokens of admitted requests.")
        self.generation_tokens = counter(contract.M_GENERATION_TOKENS, "Generated tokens.")
        self.spec_draft = counter(contract.M_SPEC_DRAFT_TOKENS, "Speculative draft tokens proposed.")
        self.spec_accepted = counter(contract.M_SPEC_ACCEPTED_TOKENS, "Speculative draft tokens accepted.")
        self.request_success = Counter(
            _counter_name(contract.M_REQUEST_SUCCESS),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(contract.M_TTFT, "Time from arrival to the first output token.")
        self.itl = histogram(contract.M_ITL, "Time between consecutive output tokens of a request.")
        self.e2e = histogram(contract.M_E2E, "Time from arrival to the last output token.")
        self.queue_time = histogram(contract.M_QUEUE_TIME, "Time a request waited before its first step.")
        self.model_name = model_name
        self._last = EngineStats()
        from baton_engine.kv_transfer.metrics import KVTransferCollector

        self.kv_transfer = KVTransferCollector(model_name, r)
        # Samples from the start: an idle engine's load must read 0, not absent (the router ranks
        # a pod whose load it cannot read after every pod whose load it can).
        for idle in (self.waiting, self.running, self.kv_usage):
            idle.labels(model_name).set(0)
        for total in (
            self.prefix_queries, self.prefix_hits, self.preemptions, self.prompt_tokens,
            self.generation_tokens, self.spec_draft, self.spec_accepted,
        ):  # fmt: skip
            total.labels(model_name)

    def update(self, stats: EngineStats) -> None:
        m = self.model_name
        if stats.kv_transfer is not None:
            self.kv_transfer.update(stats.kv_transfer)
        self.waiting.labels(m).set(stats.num_waiting)
        self.running.labels(m).set(stats.num_running)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.kv_blocks.labels(m).set(stats.num_kv_blocks)
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_queried_tokens, last.prefix_queried_tokens),
            (self.prefix_hits, stats.prefix_hit_tokens, last.prefix_hit_tokens),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
            (self.prompt_tokens, stats.prompt_tokens, last.prompt_tokens),
            (self.generation_tokens, stats.generation_tokens, last.generation_tokens),
            (self.spec_draft, stats.spec_draft_tokens, last.spec_draft_tokens),
            (self.spec_accepted, stats.spec_accepted_tokens, last.spec_accepted_tokens),
        ):
            if now > before:
                counter.labels(m).inc(now - before)
        self._last = stats

    def observe_finished(
        self,
        finish_reason: str,
        *,
        ttft: float | None,
        e2e: float,
        queue_time: float | None,
        inter_token: list[float],
    ) -> None:
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        self.e2e.labels(m).observe(e2e)
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)
        itl = self.itl.labels(m)
        for gap in inter_token:
            itl.observe(gap)
