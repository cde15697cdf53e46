"""Pods (API JSON) -> real scrapes on loopback -> Observations -> a decision, end to end in-process."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from baton_operator.autoscaler.collect import collect
from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import History
from baton_support.metrics_servers import MetricsServer, answer

from .exposition import engine_exposition
from .factories import decode_pool, policy, prefill_pool
from .pod_json import GPU_MESSAGE, pod


@pytest.fixture
def engines() -> Iterator[list[MetricsServer]]:
    servers = [
        MetricsServer(answer(200, engine_exposition(waiting=7, running=1, kv_usage=0.1))),  # prefill
        MetricsServer(answer(500, "boom")),  # a second prefill pod, broken
        MetricsServer(answer(200, engine_exposition(waiting=0, running=30, kv_usage=0.9))),  # decode
    ]
    yield servers
    for server in servers:
        server.stop()


async def test_collect_and_decide(engines: list[MetricsServer]) -> None:
    def running(name: str, role: str, server: MetricsServer, *, ready: bool = True) -> dict[str, object]:
        address = urlsplit(server.url)
        return pod(name, role, ip=address.hostname, port=address.port, ready=ready)

    gpu_wait = pod(
        "decode-b",
        "decode",
        phase="Pending",
        ip=None,
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": GPU_MESSAGE}
        ],
    )
    pods = [
        running("prefill-a", "prefill", engines[0]),
        running("prefill-b", "prefill", engines[1]),
        running("prefill-c", "prefill", engines[1], ready=False),  # starting: not scraped
        running("decode-a", "decode", engines[2]),
        gpu_wait,
    ]
    obs = await collect(pods, {"prefill": 3, "decode": 2}, timeout_s=2)
    assert [(s.pod, s.load is not None, s.error) for s in obs.samples] == [
        ("prefill-a", True, None),
        ("prefill-b", False, "HTTP 500"),
        ("decode-a", True, None),
    ]
    assert [p.pod for p in obs.pending] == ["decode-b"]

    decision, _ = decide(policy(prefill_pool(), decode_pool()), obs, History(), obs.samples[0].scraped_at)
    assert decision.reason == (
        "prefill: scale up 3 -> 4: recommend 4 (queue depth 14 / target 4 -> 4, "
        "1 of 2 ready pods unknown, assumed at the known mean) | "
        # The Pending pod is one of the 2 replicas already: nothing more is asked for.
        "decode: hold at 2: recommend 2 (KV usage 0.90 x 1 pod / target 0.60 -> 2)"
    )
