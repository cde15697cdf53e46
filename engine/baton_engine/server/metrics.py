"""Prometheus metrics of one engine pod (names from `baton_engine.contract`).

Gauges and counters mirror the engine core's `EngineStats` snapshots (counters advance by the
difference between snapshots, so they never go backwards); the latency histograms are observed
by the server process, which sees each request's tokens when the client does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton_engine import contract
from baton_engine.core.engine_stats import EngineStats

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
        self.spec_num_drafts = counter(
            contract.M_SPEC_NUM_DRAFTS, "Speculative verify rows (decode rows that carried drafts)."
        )
        self.spec_accepted_per_position = Counter(
            _counter_name(contract.M_SPEC_ACCEPTED_PER_POSITION),
            "Verify rows whose draft at `position` (0-based) was accepted.",
            ["model_name", "position"],
            registry=r,
        )
        self.spec_acceptance_rate = gauge(
            contract.M_SPEC_ACCEPTANCE_RATE, "Accepted / proposed draft tokens since start (0..1)."
        )
        self.spec_tokens_per_forward = gauge(
            contract.M_SPEC_TOKENS_PER_FORWARD,
            "Mean tokens a verify row gained per forward since start (accepted drafts + 1).",
        )
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
        self._last = EngineStats()
        from baton_engine.kv_transfer.metrics import KVTransferCollector

        self.kv_transfer = KVTransferCollector(model_name, r)
        self.model_name = model_name
        if model_name:
            self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """Label every series with the served model name, and create them at 0 so that a
        counter that never moved (e.g. no prefix hit yet) is still exposed."""
        self.model_name = model_name
        self.kv_transfer.model_name = model_name
        for metric in (
            self.waiting, self.running, self.kv_usage, self.kv_blocks, self.prefix_queries,
            self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens,
            self.spec_draft, self.spec_accepted, self.ttft, self.itl, self.e2e, self.queue_time,
            self.spec_num_drafts, self.spec_acceptance_rate, self.spec_tokens_per_forward,
        ):  # fmt: skip
            metric.labels(model_name)

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
            (self.spec_num_drafts, stats.spec_num_drafts, last.spec_num_drafts),
        ):
            if now > before:
                counter.labels(m).inc(now - before)
        self._update_spec_decode(stats, last)
        self._last = stats

    def _update_spec_decode(self, stats: EngineStats, last: EngineStats) -> None:
        if not stats.spec_num_drafts:
            return
        m = self.model_name
        previous = last.spec_accepted_per_position
        for position, count in enumerate(stats.spec_accepted_per_position):
            before = previous[position] if position < len(previous) else 0
            child = self.spec_accepted_per_position.labels(m, str(position))
            if count > before:
                child.inc(count - before)
        self.spec_acceptance_rate.labels(m).set(stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1))
        self.spec_tokens_per_forward.labels(m).set(1.0 + stats.spec_accepted_tokens / stats.spec_num_drafts)

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
