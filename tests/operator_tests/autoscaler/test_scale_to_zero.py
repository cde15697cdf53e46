"""Scale to zero in the pure policy: the idle clock, both pools to zero together, the wake-up by
requests the routers hold (at once, past any stabilization window), and its history in status."""

from __future__ import annotations

import json

import pytest

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import (
    AutoscalingPolicy,
    History,
    Observations,
    PodSample,
    RouterDemand,
    ScaleToZero,
    StepPolicy,
)
from baton_operator.autoscaler.status_record import history_from_dict, history_to_dict

from .factories import NOW, decode_pool, prefill_pool, sample

IDLE_S = 300.0
SLOW_UP = StepPolicy(max_step=1, stabilization_window_s=120)  # waking must not wait for it
POLICY = AutoscalingPolicy(
    pools=(
        prefill_pool(min_replicas=0, scale_up=SLOW_UP),
        decode_pool(min_replicas=0, scale_up=SLOW_UP),
    ),
    scale_to_zero=ScaleToZero(idle_s=IDLE_S),
)
IDLE_PODS = (sample("prefill-0"), sample("decode-0", "decode"))


def observe(
    prefill: int, decode: int, *samples: PodSample, held: float = 0, requests: float | None = 40
) -> Observations:
    demand = None if requests is None else RouterDemand(held=held, requests=requests)
    return Observations(replicas={"prefill": prefill, "decode": decode}, samples=samples, demand=demand)


def seen(ago: float | None, requests: float = 40) -> History:
    """History whose last request was seen `ago` seconds before NOW (None: never looked)."""
    return History(active_at=None if ago is None else NOW - ago, router_requests=requests)


def outcome(observations: Observations, history: History) -> dict[str, tuple[int, str, str]]:
    decision, _ = decide(POLICY, observations, history, NOW)
    return {r.role: (r.desired, r.action, r.reason) for r in decision.roles}


def test_idle_for_the_whole_period_sends_both_pools_to_zero() -> None:
    got = outcome(observe(1, 1, *IDLE_PODS), seen(IDLE_S))
    assert got == {
        "prefill": (0, "down", "scale down 1 -> 0: scaled to zero (idle 300 s)"),
        "decode": (0, "down", "scale down 1 -> 0: scaled to zero (idle 300 s)"),
    }


def test_several_pods_go_to_zero_in_one_decision() -> None:
    samples = (*IDLE_PODS, sample("prefill-1"), sample("decode-1", "decode"), sample("decode-2", "decode"))
    got = outcome(observe(2, 3, *samples), seen(IDLE_S + 40))
    assert got["prefill"][:2] == (0, "down") and got["decode"][:2] == (0, "down")
    assert got["decode"][2] == "scale down 3 -> 0: scaled to zero (idle 300 s)"


@pytest.mark.parametrize(
    ("observations", "history"),
    [
        pytest.param(observe(1, 1, *IDLE_PODS), seen(IDLE_S - 1), id="one second short"),
        pytest.param(observe(1, 1, *IDLE_PODS, requests=41), seen(IDLE_S + 60), id="a request arrived"),
        pytest.param(observe(1, 1, *IDLE_PODS, requests=3), seen(IDLE_S + 60), id="router restarted"),
        pytest.param(observe(1, 1, *IDLE_PODS, held=1), seen(IDLE_S + 60), id="a request held"),
        pytest.param(
            observe(1, 1, sample("prefill-0"), sample("decode-0", "decode", running=1)),
            seen(IDLE_S + 60),
            id="a request running",
        ),
        pytest.param(
            observe(1, 1, sample("prefill-0", waiting=2), sample("decode-0", "decode")),
            seen(IDLE_S + 60),
            id="requests queued",
        ),
        pytest.param(observe(1, 1, *IDLE_PODS, requests=None), seen(IDLE_S + 60), id="router unreadable"),
        pytest.param(observe(1, 1, *IDLE_PODS), seen(None), id="first look"),
    ],
)
def test_activity_keeps_the_pools_at_one_pod(observations: Observations, history: History) -> None:
    got = outcome(observations, history)
    assert {role: desired for role, (desired, _, _) in got.items()} == {"prefill": 1, "decode": 1}
    assert got["prefill"][2] == (
        "hold at 1: recommend 1 (queue depth 0 / target 4 -> 0, kept at 1 until idle)"
        if not observations.samples[0].load or not observations.samples[0].load.waiting
        else "hold at 1: recommend 1 (queue depth 2 / target 4 -> 1)"
    )


def test_activity_restarts_the_idle_clock_and_the_count_is_kept() -> None:
    _, kept = decide(POLICY, observe(1, 1, *IDLE_PODS, requests=41), seen(IDLE_S + 60), NOW)
    assert (kept.active_at, kept.router_requests) == (NOW, 41)
    _, quiet = decide(POLICY, observe(1, 1, *IDLE_PODS, requests=41), kept, NOW + 10)
    assert (quiet.active_at, quiet.router_requests) == (NOW, 41)  # nothing new: the clock runs on
    _, blind = decide(POLICY, observe(1, 1, *IDLE_PODS, requests=None), kept, NOW + 20)
    assert (blind.active_at, blind.router_requests) == (None, 41)  # unreadable: the clock restarts later


def test_held_requests_wake_both_pools_at_once() -> None:
    got = outcome(observe(0, 0, held=3, requests=52), seen(900, requests=52))
    assert got == {
        "prefill": (1, "up", "scale up 0 -> 1: woken by 3 waiting requests"),
        "decode": (1, "up", "scale up 0 -> 1: woken by 3 waiting requests"),
    }
    assert outcome(observe(0, 0, held=1, requests=52), seen(900, requests=52))["decode"][2] == (
        "scale up 0 -> 1: woken by 1 waiting request"
    )


def test_requests_refused_at_zero_wake_the_pools_too() -> None:
    """A burst beyond the routers' queue got 503s and is gone before the next decision: the
    routers' count still shows it."""
    got = outcome(observe(0, 0, held=0, requests=60), seen(900, requests=52))
    assert got["prefill"] == (1, "up", "scale up 0 -> 1: woken by requests the routers refused while at zero")


def test_a_restarted_router_is_no_demand_until_it_counts_requests() -> None:
    """A router that restarted counts from zero again: a lower count is not a request; what it
    counts once restarted is (a request it refused, timed out, at zero)."""
    idle = "hold at 0: scaled to zero (idle 300 s); no request waiting"
    assert outcome(observe(0, 0, requests=0), seen(900, requests=52))["decode"] == (0, "hold", idle)
    _, kept = decide(POLICY, observe(0, 0, requests=0), seen(900, requests=52), NOW)
    assert kept.router_requests == 0
    assert outcome(observe(0, 0, requests=1), seen(900, requests=52))["decode"] == (
        1,
        "up",
        "scale up 0 -> 1: woken by requests the routers refused while at zero",
    )


@pytest.mark.parametrize(
    ("requests", "reason"),
    [
        (52, "hold at 0: scaled to zero (idle 300 s); no request waiting"),
        (None, "hold at 0: scaled to zero; the routers' metrics are unknown"),
    ],
)
def test_at_zero_without_demand_the_pools_stay_there(requests: float | None, reason: str) -> None:
    got = outcome(observe(0, 0, requests=requests), seen(900, requests=52))
    assert got == {"prefill": (0, "hold", reason), "decode": (0, "hold", reason)}


def test_aggregated_pool_scales_to_zero_alone() -> None:
    pool = decode_pool(role="engine", min_replicas=0, target_queue_depth=4.0)
    policy = AutoscalingPolicy(pools=(pool,), scale_to_zero=ScaleToZero(idle_s=60))
    observations = Observations(
        replicas={"engine": 2},
        samples=(sample("e0", "engine"), sample("e1", "engine")),
        demand=RouterDemand(0, 7),
    )
    decision, _ = decide(policy, observations, History(active_at=NOW - 61, router_requests=7), NOW)
    assert [(r.desired, r.reason) for r in decision.roles] == [
        (0, "scale down 2 -> 0: scaled to zero (idle 60 s)")
    ]


def test_history_in_status_keeps_the_idle_clock() -> None:
    history = History(active_at=NOW - 12.5, router_requests=41.0)
    raw = json.loads(json.dumps(history_to_dict(history)))
    assert raw == {"recommendations": [], "actions": [], "activeAt": 9987.5, "routerRequests": 41.0}
    assert history_from_dict(raw) == history
    assert history_from_dict({"recommendations": [], "actions": []}) == History()
    with pytest.raises(ValueError, match=r"history\.activeAt: must be a non-negative number, got 'soon'"):
        history_from_dict({"activeAt": "soon"})


def test_the_spec_turns_scale_to_zero_on_with_both_pools_at_zero() -> None:
    from baton_operator.autoscaler.spec_adapter import policy_from_spec
    from baton_operator.models import InferenceDeploymentSpec

    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": "builtin:smollm2-135m-instruct"},
            "autoscaling": {
                "mode": "builtin",
                "scaleToZeroIdleSeconds": 120,
                "prefill": {"minReplicas": 0},
                "decode": {"minReplicas": 0},
            },
        }
    )
    policy = policy_from_spec(spec.autoscaling.model_dump(by_alias=True))
    assert policy.scale_to_zero == ScaleToZero(idle_s=120)
    assert [p.min_replicas for p in policy.pools] == [0, 0]
    default = InferenceDeploymentSpec.model_validate({"model": {"name": "m", "source": "builtin:x"}})
    assert policy_from_spec(default.autoscaling.model_dump(by_alias=True)).scale_to_zero is None


def test_router_demand_is_read_from_its_metrics() -> None:
    from baton_operator.autoscaler.metrics import MetricsParseError, parse_router_demand

    text = (
        "# TYPE baton_router_requests_held gauge\nbaton_router_requests_held 3.0\n"
        "# TYPE baton_router_requests_total counter\n"
        'baton_router_requests_total{mode="disaggregated",outcome="success"} 40.0\n'
        'baton_router_requests_total{mode="disaggregated",outcome="unavailable"} 2.0\n'
        "baton_router_requests_held_extra 9\n"
    )
    assert parse_router_demand(text) == RouterDemand(held=3, requests=42)
    assert parse_router_demand("baton_router_requests_held 0\n") == RouterDemand(held=0, requests=0)
    with pytest.raises(MetricsParseError, match="baton_router_requests_held: missing"):
        parse_router_demand("baton_router_requests_total 4\n")


def test_router_pods_are_scrape_targets_ready_or_not() -> None:
    from baton_operator.autoscaler.pods import router_targets

    def router(
        name: str, phase: str = "Running", ip: str | None = "10.0.0.9", **meta: str
    ) -> dict[str, object]:
        return {
            "metadata": {"name": name, "labels": {"baton.dev/role": "router"}, **meta},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]},
        }

    pods = [router("r0"), router("r1", phase="Pending"), router("r2", ip=None),
            router("r3", deletionTimestamp="2026-12-01T00:00:00Z")]  # fmt: skip
    assert [(t.pod, t.url) for t in router_targets(pods)] == [("r0", "http://10.0.0.9:8080/metrics")]
