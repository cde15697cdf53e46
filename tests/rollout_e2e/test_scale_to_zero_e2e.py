"""Scale to zero and back end to end on the local control plane: real engines (SmolLM2 on CPU)
on a process node, the router (which stays up), the operator as a process; the scenario of
`python -m bench.cold_start --quick` (its helpers), with its outcome checked.

1. No request: after scaleToZeroIdleSeconds both pools are at zero pods; status and Events say
   "scaled to zero (idle N s)", Ready is True (ScaledToZero).
2. One request: the router holds it, the autoscaler wakes both pools ("woken by 1 waiting
   request") past a scale-up window far longer than the hold timeout, and the request is
   answered; the timings are printed (recorded by bench.cold_start, never asserted).
3. Idle again, then a burst of twice the router's hold queue: exactly the queue's worth is held
   and answered, the rest get 503 with Retry-After at once; no accepted request is lost; one
   wake-up for the burst.
4. With a shorter hold timeout (a restarted router, which alone must not wake the pools), a
   request held past it gets 503 with Retry-After and still wakes both pools.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import pytest

from baton_dev.testing import DevCluster, condition, is_ready, wait_for
from baton_engine.contract import FLAG_ROUTER_HOLD_TIMEOUT
from baton_support.operator_process import OperatorProcess, cluster_operator
from bench.cold_start import QUICK, ZeroDeployment, cold_start, http_url, post

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def operator(dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with cluster_operator(dev_cluster, tmp_path_factory.mktemp("operator"), "--no-peering") as proc:
        yield proc


def test_idle_to_zero_a_request_wakes_both_pools_and_a_burst_beyond_the_queue_gets_503(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    res = ZeroDeployment(dev_cluster, k8s_namespace)
    res.create(QUICK)
    url = res.router_url()

    # 1. Idle: both pools to zero, the router stays up.
    wait_for(res.at_zero, timeout=900, interval=1, message="both pools at zero pods")
    scaled = f"scaled to zero (idle {QUICK.idle_s} s)"
    wait_for(
        lambda: len(res.events("ScaledDown")) >= 2, timeout=60, interval=0.5, message="the ScaledDown Events"
    )
    assert res.events("ScaledDown") == [
        f"decode: scale down 1 -> 0: {scaled}",
        f"prefill: scale down 1 -> 0: {scaled}",
    ]
    infd = res.get()
    assert scaled in infd["status"]["autoscaling"]["reason"]
    ready = condition(infd, "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    (router,) = res.pods("router")
    assert is_ready(router)

    # 2. One request wakes both pools; it is held until they serve it.
    result = cold_start(res, url)
    assert (result.status, bool(result.text)) == (200, True), result
    assert [m for m in res.events("ScaledUp") if "woken" in m] == [
        "decode: scale up 0 -> 1: woken by 1 waiting request",
        "prefill: scale up 0 -> 1: woken by 1 waiting request",
    ]
    print(json.dumps(asdict(result)))

    # 3. Idle again, then a burst of twice the hold queue.
    wait_for(res.at_zero, timeout=300, interval=1, message="both pools at zero pods again")
    woken_before = Counter(m for m in res.events("ScaledUp") if "woken" in m)
    with ThreadPoolExecutor(2 * QUICK.hold_queue) as pool:
        answers = list(pool.map(lambda _: post(url), range(2 * QUICK.hold_queue)))
    refused = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    assert (len(served), len(refused)) == (QUICK.hold_queue, QUICK.hold_queue), [
        a.status_code for a in answers
    ]
    for a in refused:
        assert a.headers["retry-after"] == "5"
        assert a.json()["error"]["message"] == (
            f"no decode pod available and {QUICK.hold_queue} requests already wait for one "
            f"(the router holds at most {QUICK.hold_queue})"
        )
    assert all(a.json()["choices"][0]["text"] for a in served)
    # One wake-up for the burst, both pools in the same decision. How many requests it saw
    # waiting depends on when the once-a-second autoscaler read the router while the burst
    # arrived: 1 to the queue's size.
    woken = sorted((Counter(m for m in res.events("ScaledUp") if "woken" in m) - woken_before).elements())
    assert len(woken) == 2, woken
    waiting = int(woken[0].split("woken by ")[1].split()[0])
    assert 1 <= waiting <= QUICK.hold_queue, woken
    plural = "s" if waiting != 1 else ""
    assert woken == [
        f"decode: scale up 0 -> 1: woken by {waiting} waiting request{plural}",
        f"prefill: scale up 0 -> 1: woken by {waiting} waiting request{plural}",
    ]

    # 4. A request held past the router's timeout (a new router: the pools stay at zero): 503
    # with Retry-After, and it wakes the pools all the same.
    dev_cluster.admin.patch(res.path, {"spec": {"router": {"holdTimeoutSeconds": 1}}})

    def new_router() -> dict[str, Any] | None:
        found = [p for p in res.pods("router") if not p["metadata"].get("deletionTimestamp")]
        args = found[0]["spec"]["containers"][0]["args"] if len(found) == 1 else []
        timeout = args[args.index(FLAG_ROUTER_HOLD_TIMEOUT) + 1] if FLAG_ROUTER_HOLD_TIMEOUT in args else ""
        return found[0] if timeout == "1" and is_ready(found[0]) and len(res.pods("router")) == 1 else None

    url = http_url(wait_for(new_router, timeout=300, interval=1, message="the new router"), "/v1/completions")
    wait_for(res.at_zero, timeout=300, interval=1, message="both pools at zero, the router restarted")
    woken_before = Counter(m for m in res.events("ScaledUp") if "woken" in m)
    late = post(url)
    assert (late.status_code, late.headers["retry-after"]) == (503, "5")
    assert late.json()["error"]["message"] == "no decode pod became available within 1 s"

    def woken() -> list[str]:
        return sorted((Counter(m for m in res.events("ScaledUp") if "woken" in m) - woken_before).elements())

    wait_for(lambda: len(woken()) == 2, timeout=60, interval=0.5, message="the pools woken")
    # Read while held, or once it was refused: the autoscaler reads the router once a second.
    assert woken() in (
        [f"{role}: scale up 0 -> 1: woken by 1 waiting request" for role in ("decode", "prefill")],
        [
            f"{role}: scale up 0 -> 1: woken by requests the routers refused while at zero"
            for role in ("decode", "prefill")
        ],
    )
