"""Real Prometheus text exposition, written by a real prometheus_client registry the way an engine would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from baton_engine import contract

QUEUED_TOKENS = "baton_num_queued_prompt_tokens"


def engine_exposition(
    *,
    waiting: float = 3,
    running: float = 5,
    kv_usage: float = 0.42,
    models: tuple[str, ...] = ("smollm2",),
    queued_tokens: float | None = None,
    omit: tuple[str, ...] = (),
) -> str:
    """An engine's /metrics: gauges per served model, counters, a latency histogram."""
    registry = CollectorRegistry()

    def gauge(name: str, value: float) -> None:
        if name in omit:
            return
        g = Gauge(name, f"{name} help", ["model_name"], registry=registry)
        for model in models:
            g.labels(model_name=model).set(value)

    gauge(contract.M_REQUESTS_WAITING, waiting)
    gauge(contract.M_REQUESTS_RUNNING, running)
    if contract.M_KV_USAGE not in omit:
        kv = Gauge(contract.M_KV_USAGE, "KV-cache usage", ["model_name"], registry=registry)
        # One engine per model in this fake; the second model's cache is a bit fuller.
        for i, model in enumerate(models):
            kv.labels(model_name=model).set(kv_usage + 0.1 * i)
    gauge(contract.M_KV_BLOCKS_TOTAL, 1024)
    if queued_tokens is not None:
        gauge(QUEUED_TOKENS, queued_tokens)
    preemptions = Counter(contract.M_PREEMPTIONS.removesuffix("_total"), "preemptions", registry=registry)
    preemptions.inc(7)
    prompt = Counter(contract.M_PROMPT_TOKENS.removesuffix("_total"), "prompt tokens", registry=registry)
    prompt.inc(12345)
    ttft = Histogram(contract.M_TTFT, "ttft", registry=registry, buckets=(0.01, 0.1, 1.0))
    for v in (0.005, 0.05, 0.5, 5.0):
        ttft.observe(v)
    # vLLM-named series an engine might also carry must not be mistaken for Baton's.
    vllm = Gauge("vllm_num_requests_waiting", "vllm-style", registry=registry)
    vllm.set(999)
    return generate_latest(registry).decode()
