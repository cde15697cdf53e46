"""Autoscaler cost per InferenceDeployment per tick: decide(), /metrics parsing, scraping.

    python -m bench.autoscaler --json

Prints one JSON object as the last line. ``reaction_s`` (metric crossing its target -> replicas
patched) needs the operator loop on a real control plane with real engines; until that exists
it is reported as null with a note.
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
    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
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
    server = _Server(text.encode())
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


def run() -> dict[str, object]:
    policy = _policy(window_s=300)
    obs, hist = _inputs(prefill=8, decode=16, window_s=300, interval_s=15)
    decide_us = _per_call_us(lambda: decide(policy, obs, hist, NOW), calls=2000)
    long_obs, long_hist = _inputs(prefill=32, decode=64, window_s=600, interval_s=5)
    decide_large_us = _per_call_us(lambda: decide(_policy(600), long_obs, long_hist, NOW), calls=300)
    text = engine_exposition()
    parse_us = _per_call_us(lambda: parse_engine_metrics(text), calls=500)
    pods = 24
    return {
        "bench": "autoscaler",
        "decide_cpu_us": decide_us,
        "decide_inputs": "8 prefill + 16 decode pods, 300 s window at 15 s (21 recommendations/role)",
        "decide_large_cpu_us": decide_large_us,
        "decide_large_inputs": "32 prefill + 64 decode pods, 600 s window at 5 s (121 recommendations/role)",
        "parse_cpu_us_per_pod": parse_us,
        "exposition_bytes": len(text.encode()),
        "cpu_us_per_resource": round(decide_us + pods * parse_us, 1),
        "cpu_per_resource_inputs": f"decide + parse of {pods} pods",
        "scrape_ms_24_pods_loopback_concurrency16": _scrape_ms(text, pods),
        "reaction_s": None,
        "interval_s": None,
        "note": "reaction_s, interval_s: need the operator timer loop end to end (later wave)",
        "python": platform.python_version(),
        "prometheus_client": metadata.version("prometheus-client"),
        "httpx": metadata.version("httpx"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    result = run()
    if not args.json:
        for key, value in result.items():
            print(f"{key:32} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
