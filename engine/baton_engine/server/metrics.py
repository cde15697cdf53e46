"""Prometheus metrics of one engine pod (names from `baton_engine.contract`).

Gauges and counters mirror the engine core's `EngineStats` snapshots (counters advance by the
difference between snapshots, so they never go backwards); the latency histograms are observed
by the server process, which sees each request's tokens when the client does.

Each figure with a vLLM counterpart (`contract.VLLM_EQUIVALENT`) is exported under both names from
the one update (`--metric-names` turns either set off): the vLLM series carry vLLM's labels
(``model_name``, ``engine``), so llm-d's endpoint picker, KEDA rules and dashboards written for vLLM
read Baton pods. ``vllm:cache_config_info`` (value 1) carries the cache layout in its labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton_engine import contract
from baton_engine.core.engine_stats import EngineStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip

MetricNames = Literal["both", "baton", "vllm"]
METRIC_NAMES: Final[tuple[str, ...]] = ("both", "baton", "vllm")
#: vLLM's per-engine label and its value: one engine core per Baton pod.
VLLM_ENGINE_LABEL: Final = "engine"
VLLM_ENGINE: Final = "0"


def _counter_name(full: str) -> str:
    """prometheus_client appends `_total` itself; the contract names carry it."""
    return full.removesuffix("_total")


class _Children:
    """One label set of a figure in each of its families."""

    __slots__ = ("_children",)

    def __init__(self, children: Sequence[Any]) -> None:
        self._children = children

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def inc(self, amount: float = 1.0) -> None:
        for child in self._children:
            child.inc(amount)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class _Figure:
    """One figure under Baton's name and/or vLLM's: `labels(...)` takes Baton's label values; the
    vLLM family gets the same values plus vLLM's engine label."""

    __slots__ = ("_families",)

    def __init__(self, families: Sequence[tuple[Any, tuple[str, ...]]]) -> None:
        self._families = families  # (family, extra label values)

    def labels(self, *values: str) -> _Children:
        return _Children([family.labels(*values, *extra) for family, extra in self._families])

    @property
    def families(self) -> list[Any]:
        """The prometheus_client metrics behind this figure (for generated references)."""
        return [getattr(family, "family", family) for family, _ in self._families]


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        names: MetricNames = "both",
        block_size: int | None = None,
    ) -> None:
        if names not in METRIC_NAMES:
            raise ValueError(f"metric names: {names!r} is not one of {', '.join(METRIC_NAMES)}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.names = names
        self.block_size = block_size
        r = self.registry
        baton_on, vllm_on = names in ("both", "baton"), names in ("both", "vllm")

        def figure(kind: type[Any], name: str, doc: str, extra_labels: Sequence[str] = ()) -> _Figure:
            families: list[tuple[Any, tuple[str, ...]]] = []
            options: dict[str, Any] = {"buckets": _LATENCY_BUCKETS} if kind is Histogram else {}
            base = _counter_name if kind is Counter else str
            if baton_on:
                labels = ["model_name", *extra_labels]
                families.append((kind(base(name), doc, labels, registry=r, **options), ()))
            vllm = contract.VLLM_EQUIVALENT.get(name)
            if vllm_on and vllm is not None:
                labels = ["model_name", VLLM_ENGINE_LABEL, *extra_labels]
                family = kind(base(vllm), doc, labels, registry=r, **options)
                families.append((_EngineLabelled(family), ()))
            return _Figure(families)

        def gauge(name: str, doc: str) -> _Figure:
            return figure(Gauge, name, doc)

        def counter(name: str, doc: str) -> _Figure:
            return figure(Counter, name, doc)

        def histogram(name: str, doc: str) -> _Figure:
            return figure(Histogram, name, doc)

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
        self.spec_accepted_per_position = figure(
            Counter,
            contract.M_SPEC_ACCEPTED_PER_POSITION,
            "Verify rows whose draft at `position` (0-based) was accepted.",
            ["position"],
        )
        self.spec_acceptance_rate = gauge(
            contract.M_SPEC_ACCEPTANCE_RATE, "Accepted / proposed draft tokens since start (0..1)."
        )
        self.spec_tokens_per_forward = gauge(
            contract.M_SPEC_TOKENS_PER_FORWARD,
            "Mean tokens a verify row gained per forward since start (accepted drafts + 1).",
        )
        self.request_success = figure(
            Counter, contract.M_REQUEST_SUCCESS, "Finished requests, by finish reason.", ["finished_reason"]
        )
        self.cache_config: Gauge | None = None
        if vllm_on:
            self.cache_config = Gauge(
                contract.VM_CACHE_CONFIG,
                "Information of the engine's KV cache (value 1; vLLM's CacheConfig labels).",
                [
                    VLLM_ENGINE_LABEL,
                    "block_size",
                    "num_gpu_blocks",
                    "enable_prefix_caching",
                ],  # as vLLM: no model
                registry=r,
            )
        self.enable_prefix_caching = True
        self._cache_config_labels: tuple[str, ...] | None = None
        self.ttft = histogram(contract.M_TTFT, "Time from arrival to the first output token.")
        self.itl = histogram(contract.M_ITL, "Time between consecutive output tokens of a request.")
        self.e2e = histogram(contract.M_E2E, "Time from arrival to the last output token.")
        self.queue_time = histogram(contract.M_QUEUE_TIME, "Time a request waited before its first step.")
        self._last = EngineStats()
        from baton_engine.kv_transfer.metrics import KVTransferCollector

        self.kv_transfer = KVTransferCollector(model_name, r) if baton_on else None
        self.model_name = model_name
        if model_name:
            self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """Label every series with the served model name, and create them at 0 so that a
        counter that never moved (e.g. no prefix hit yet) is still exposed."""
        self.model_name = model_name
        if self.kv_transfer is not None:
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
        if stats.kv_transfer is not None and self.kv_transfer is not None:
            self.kv_transfer.update(stats.kv_transfer)
        self._set_cache_config(stats.num_kv_blocks)
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

    def _set_cache_config(self, num_blocks: int) -> None:
        if self.cache_config is None or not num_blocks:
            return
        labels = (
            VLLM_ENGINE,
            "" if self.block_size is None else str(self.block_size),
            str(num_blocks),
            str(self.enable_prefix_caching),
        )
        if labels != self._cache_config_labels:
            if self._cache_config_labels is not None:
                self.cache_config.remove(*self._cache_config_labels)
            self.cache_config.labels(*labels).set(1)
            self._cache_config_labels = labels

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


class _EngineLabelled:
    """A vLLM-named family whose label values get vLLM's engine index after the model name."""

    __slots__ = ("family",)

    def __init__(self, family: Any) -> None:
        self.family = family

    def labels(self, model_name: str, *rest: str) -> Any:
        return self.family.labels(model_name, VLLM_ENGINE, *rest)
