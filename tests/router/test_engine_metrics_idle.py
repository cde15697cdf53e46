"""An engine that has served nothing yet exposes its load as 0, so the router can rank it."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_engine import contract
from baton_engine.server.metrics import EngineMetrics


def test_idle_engine_exposes_zero_load_and_counters() -> None:
    metrics = EngineMetrics("smollm2")
    samples = {
        s.name: (s.labels, s.value)
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    for name in (
        contract.M_REQUESTS_WAITING,
        contract.M_REQUESTS_RUNNING,
        contract.M_KV_USAGE,
        contract.M_PREFIX_HITS,
        contract.M_PREFIX_QUERIES,
    ):
        assert samples[name] == ({"model_name": "smollm2"}, 0.0), name
