"""Autoscaler cost per InferenceDeployment per tick: decide(), /metrics parsing, scraping.

    python -m bench.autoscaler --json

Prints one JSON object as the last line. ``reaction_s`` (metric crossing its target -> replicas
patched, observed on a real API server with the operator as a process) comes from
``bench.autoscaler_reaction``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from baton_engine import contract
from baton_operator.autoscaler.collect import collect
from baton_operator.autoscaler.metrics import ScrapeTarget, parse_engine_metrics, scrape_pods
from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import (
    AutoscalingPolicy,
    EngineLoad,
    History,
    Observations,
    PendingPod,
    PodSample,
    PoolPolicy,
    RatioBounds,
    Recommendation,
    ScaleAction,
    StepPolicy,
)
from bench import autoscaler_reaction

NOW = 1_800_000_000.0


def _policy(window_s: float) -> AutoscalingPolicy:
    up, down = StepPolicy(2, 0), StepPolicy(1, window_s)
    return AutoscalingPolicy(
        pools=(
            PoolPolicy("prefill", 1, 16, up, down, target_queue_depth=4, target_queued_tokens=8192),
            PoolPolicy("decode", 1, 32, up, down, target_kv_usage=0.7, target_running_requests=64),
        ),
        ratio=RatioBounds(min_prefill_per_decode=0.25, max_prefill_per_decode=2),
    )


def _inputs(prefill: int, decode: int, window_s: float, interval_s: float) -> tuple[Observations, History]:
    """A busy deployment: varied load, one unknown pod, one Pending pod, a full window of history."""
    samples = [
        PodSample(f"prefill-{i}", "prefill", True, NOW - 1, EngineLoad(3 + i % 4, 2, 0.3, 3000.0 + 100 * i))
        for i in range(prefill)
    ]
    samples += [
        PodSample(f"decode-{i}", "decode", True, NOW - 1, EngineLoad(0, 40 + i, 0.55 + 0.01 * (i % 10), 0.0))
        for i in range(decode)
    ]
    samples[-1] = PodSample(samples[-1].pod, "decode", True, NOW - 1, None, "timeout after 2s")
    pending = (PendingPod("decode-new", "decode", "Unschedulable: 0/4 nodes are available", True),)
    recs: list[Recommendation] = []
    t = NOW - window_s - interval_s
    while t < NOW:
        recs += [Recommendation(t, "prefill", prefill), Recommendation(t, "decode", decode)]
        t += interval_s
    actions = (ScaleAction(NOW - window_s / 2, "prefill", prefill - 1, prefill),)
    return Observations({"prefill": prefill, "decode": decode}, tuple(samples), pending), History(
        tuple(recs), actions
    )


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over repeats of the mean CPU time per call, in microseconds (process CPU time, so
    other work on a shared machine does not inflate it)."""
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - start) / calls * 1e6)
    return round(statistics.median(runs), 2)


def engine_exposition() -> str:
    """What one engine's /metrics looks like: its gauges, counters and latency histograms."""
    registry = CollectorRegistry()
    for name, value in (
        (contract.M_REQUESTS_WAITING, 3),
        (contract.M_REQUESTS_RUNNING, 17),
        (contract.M_KV_USAGE, 0.61),
        (contract.M_KV_BLOCKS_TOTAL, 4096),
    ):
        Gauge(name, name, ["model_name"], registry=registry).labels("smollm2").set(value)
    for name in (
        contract.M_PREFIX_QUERIES,
        contract.M_PREFIX_HITS,
        contract.M_PREEMPTIONS,
        contract.M_PROMPT_TOKENS,
        contract.M_GENERATION_TOKENS,
        contract.M_REQUEST_SUCCESS,
        contract.M_KV_TRANSFER_BYTES,
        contract.M_KV_TRANSFER_FAILURES,
    ):
        Counter(name.removesuffix("_total"), name, ["model_name"], registry=registry).labels("smollm2").inc(
            1234
        )
    for name in (
        contract.M_TTFT,
        contract.M_ITL,
        contract.M_E2E,
        contract.M_QUEUE_TIME,
        contract.M_KV_TRANSFER_SECONDS,
    ):
        h = Histogram(name, name, ["model_name"], registry=registry).labels("smollm2")
        for v in (0.001, 0.02, 0.3, 4.0):
            h.observe(v)
    return generate_latest(registry).decode()


class _Server:
    def __init__(self, render: Callable[[], bytes]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = render()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the default backlog of 5 drops SYNs of 24 parallel scrapes

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def _scrape_ms(text: str, pods: int, rounds: int = 5) -> float:
    """Median wall time of one scrape of ``pods`` pods, with one client kept across ticks as the
    operator keeps it (creating an httpx client costs ~0.1 s: its TLS context)."""
    body = text.encode()
    server = _Server(lambda: body)
    host, port = server.httpd.server_address[:2]
    targets = [ScrapeTarget(f"p{i}", "decode", f"http://{host!s}:{port}/metrics") for i in range(pods)]

    async def measure() -> list[float]:
        times = []
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(rounds + 1):
                start = time.perf_counter()
                samples = await scrape_pods(targets, client=client, timeout_s=5, concurrency=16)
                times.append((time.perf_counter() - start) * 1e3)
                if any(s.load is None for s in samples):
                    raise RuntimeError(f"scrape failed: {[s.error for s in samples if s.error]}")
        return times[1:]  # the first round opens the connections

    try:
        return round(statistics.median(asyncio.run(measure())), 2)
    finally:
        server.stop()


def _decision_reaction_s(interval_s: float, phases: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[float]:
    """Seconds from an engine's queue depth crossing the target to the first "up" decision of a
    loop that ticks every ``interval_s`` (collect = real scrape over loopback, then decide). The
    crossing lands at a different phase of the interval in each trial. No Deployment is patched."""
    registry = CollectorRegistry()
    waiting = Gauge(contract.M_REQUESTS_WAITING, "w", ["model_name"], registry=registry).labels("m")
    Gauge(contract.M_REQUESTS_RUNNING, "r", ["model_name"], registry=registry).labels("m").set(0)
    Gauge(contract.M_KV_USAGE, "kv", ["model_name"], registry=registry).labels("m").set(0.1)
    server = _Server(lambda: generate_latest(registry))
    host, port = server.httpd.server_address[:2]
    pod = {
        "metadata": {"name": "prefill-0", "labels": {contract.LABEL_ROLE: contract.ROLE_PREFILL}},
        "spec": {"containers": [{"ports": [{"name": contract.PORT_HTTP, "containerPort": port}]}]},
        "status": {
            "phase": "Running",
            "podIP": str(host),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    policy = AutoscalingPolicy(
        pools=(PoolPolicy("prefill", 1, 4, StepPolicy(2, 0), StepPolicy(1, 300), target_queue_depth=4),),
        max_metric_age_s=3 * interval_s,
    )

    async def trial(client: httpx.AsyncClient, phase: float) -> float:
        waiting.set(0)
        crossed: list[float] = []

        def cross() -> None:
            waiting.set(12)  # 12 waiting / target 4 -> 3 replicas
            crossed.append(time.time())

        asyncio.get_running_loop().call_later((2 + phase) * interval_s, cross)
        start, hist = time.monotonic(), History()
        for tick in range(10):
            await asyncio.sleep(max(0.0, start + tick * interval_s - time.monotonic()))
            obs = await collect([pod], {"prefill": 1}, client=client, timeout_s=interval_s)
            decision, hist = decide(policy, obs, hist, time.time())
            if decision.action == "up":
                return time.time() - crossed[0]
        raise RuntimeError("no scale-up decision within 10 ticks")

    async def trials() -> list[float]:
        async with httpx.AsyncClient(trust_env=False) as client:
            return [await trial(client, phase) for phase in phases]

    try:
        return asyncio.run(trials())
    finally:
        server.stop()


def run(quick: bool = False) -> dict[str, object]:
    """The full measurement; ``quick`` runs every part with fewer calls and trials (a smoke run)."""
    scale = 10 if quick else 1
    policy = _policy(window_s=300)
    obs, hist = _inputs(prefill=8, decode=16, window_s=300, interval_s=15)
    decide_us = _per_call_us(lambda: decide(policy, obs, hist, NOW), calls=2000 // scale)
    long_obs, long_hist = _inputs(prefill=32, decode=64, window_s=600, interval_s=5)
    decide_large_us = _per_call_us(lambda: decide(_policy(600), long_obs, long_hist, NOW), calls=300 // scale)
    text = engine_exposition()
    parse_us = _per_call_us(lambda: parse_engine_metrics(text), calls=500 // scale)
    pods = 24
    interval_s = 1.0
    reactions = _decision_reaction_s(interval_s, (0.5,) if quick else (0.1, 0.5, 0.9))
    patched = autoscaler_reaction.measure(interval_s=1, trials=2 if quick else 6)
    return {
        "bench": "autoscaler",
        "quick": quick,
        "decide_cpu_us": decide_us,
        "decide_inputs": "8 prefill + 16 decode pods, 300 s window at 15 s (21 recommendations/role)",
        "decide_large_cpu_us": decide_large_us,
        "decide_large_inputs": "32 prefill + 64 decode pods, 600 s window at 5 s (121 recommendations/role)",
        "parse_cpu_us_per_pod": parse_us,
        "exposition_bytes": len(text.encode()),
        "cpu_us_per_resource": round(decide_us + pods * parse_us, 1),
        "cpu_per_resource_inputs": f"decide + parse of {pods} pods",
        "scrape_ms_24_pods_loopback_concurrency16": _scrape_ms(text, pods),
        "decision_reaction_s_max": round(max(reactions), 3),
        "decision_reaction_s_mean": round(statistics.mean(reactions), 3),
        "decision_interval_s": interval_s,
        "reaction_s": round(max(patched), 3),
        "reaction_s_mean": round(statistics.mean(patched), 3),
        "reaction_trials": len(patched),
        "interval_s": 1,
        "reaction_target_s": 1 + 1,
        "note": "reaction_s: the worst of the trials, queue depth crossing its target -> the prefill "
        "Deployment's replicas patched, seen on a real API server, with `baton-operator run` as a "
        "process (chart RBAC) and intervalSeconds 1; decision_reaction_s is crossing -> first 'up' "
        "decision of an in-process loop (real scrape + decide, no patch)",
        "python": platform.python_version(),
        "prometheus_client": metadata.version("prometheus-client"),
        "httpx": metadata.version("httpx"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--quick", action="store_true", help="fewer calls and trials: a smoke run")
    args = parser.parse_args()
    result = run(args.quick)
    if not args.json:
        for key, value in result.items():
            print(f"{key:32} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
