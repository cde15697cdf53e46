"""Autoscaler metrics in a real prometheus_client registry, read back through the text exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import Decision, History, PodSample
from baton_operator.autoscaler.telemetry import AutoscalerMetrics, scale_event

from .factories import GPU_REASON, NOW, decode_pool, observe, pending, policy, prefill_pool, sample, unknown


def _decision() -> tuple[Decision, tuple[PodSample, ...]]:
    obs = observe(
        {"prefill": 1, "decode": 2},
        sample("p0", waiting=12),
        sample("d0", "decode", kv=0.9),
        unknown("d1", "decode"),
        pending=(pending("d2", "decode"),),
    )
    decision, _ = decide(policy(prefill_pool(), decode_pool()), obs, History(), NOW)
    return decision, obs.samples


def _lines(registry: CollectorRegistry) -> set[str]:
    return {
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith("baton_autoscaler") and "_created" not in line
    }


def test_record_and_forget() -> None:
    registry = CollectorRegistry()
    metrics = AutoscalerMetrics(registry)
    decision, samples = _decision()
    metrics.record("ns", "demo", decision, samples, scaled=(("prefill", "up"),))
    key = 'deployment="demo",namespace="ns"'
    assert _lines(registry) == {
        'baton_autoscaler_scale_actions_total{deployment="demo",direction="up",namespace="ns",'
        'role="prefill"} 1.0',
        f'baton_autoscaler_decisions_total{{action="up",{key}}} 1.0',
        f'baton_autoscaler_desired_replicas{{{key},role="prefill"}} 3.0',
        f'baton_autoscaler_desired_replicas{{{key},role="decode"}} 2.0',
        f'baton_autoscaler_current_replicas{{{key},role="prefill"}} 1.0',
        f'baton_autoscaler_current_replicas{{{key},role="decode"}} 2.0',
        f'baton_autoscaler_scrape_failures_total{{{key},role="decode"}} 1.0',
    }
    metrics.forget("ns", "demo")
    assert not any("replicas" in line for line in _lines(registry))


def test_a_refused_resize_is_counted_as_a_failure_not_an_action() -> None:
    registry = CollectorRegistry()
    metrics = AutoscalerMetrics(registry)
    decision, _ = _decision()
    metrics.record("ns", "demo", decision, scaled=(), refused=(("prefill", "up"),))
    counted = {line for line in _lines(registry) if "_total" in line}
    assert counted == {
        'baton_autoscaler_scale_failures_total{deployment="demo",direction="up",namespace="ns",'
        'role="prefill"} 1.0',
        'baton_autoscaler_decisions_total{action="up",deployment="demo",namespace="ns"} 1.0',
    }


def test_scale_events_only_for_resized_pools() -> None:
    decision, _ = _decision()
    assert [scale_event(r) for r in decision.roles] == [
        ("ScaledUp", "prefill: scale up 1 -> 3: recommend 3 (queue depth 12 / target 4 -> 3)"),
        None,
    ]
    assert decision.role("decode").reason.endswith(f"1 pod Pending ({GPU_REASON})")
