"""The Grafana dashboard shipped in the chart: well-formed, and every series it queries is one
that a live engine pair (prefill producer, decode consumer) and a live router actually expose
after a request has gone through them."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_engine import contract
from baton_operator.autoscaler.telemetry import AutoscalerMetrics
from tests.demo.dashboard import expressions, family_of, load, queried_series
from tests.server.server_process import ServerProcess, free_port, wait_for

MODEL = "builtin:smollm2-135m-instruct"
NAME = "smollm2"
ENGINE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "512", "--dtype", "float32")
ENGINE_ARGS += ("--served-model-name", NAME)
BATON_ROUTER = str(Path(sys.executable).with_name("baton-router"))
# Series of the operator's built-in autoscaler: exported by the operator process (not started
# here), so they are checked against the autoscaler's own registry.
AUTOSCALER_PREFIX = "baton_autoscaler_"


def families(exposition: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(exposition)}


def test_dashboard_shape() -> None:
    doc = load()
    assert doc["uid"] == "baton-overview"
    titles = [p["title"] for p in doc["panels"]]
    assert titles == [
        "Load",
        "Queue depth (requests waiting)",
        "KV-cache usage",
        "Latency",
        "Time to first token",
        "Inter-token latency",
        "Router time to first byte",
        "Router requests by outcome",
        "KV transfer (prefill → decode)",
        "KV-transfer throughput",
        "KV-transfer time",
        "KV-transfer failures, expired leases, router fallbacks",
        "Scaling",
        "Pods per role (as the router sees them)",
        "Autoscaler: desired vs current replicas, scale actions",
    ]
    ids = [p["id"] for p in doc["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    for expr in expressions(doc):
        assert expr.count("(") == expr.count(")"), expr


def test_autoscaler_series_exist_in_the_autoscaler_registry() -> None:
    registry = CollectorRegistry()
    AutoscalerMetrics(registry)
    exposed = families(generate_latest(registry).decode())
    wanted = {s for s in queried_series(load()) if s.startswith(AUTOSCALER_PREFIX)}
    assert wanted == {
        "baton_autoscaler_desired_replicas",
        "baton_autoscaler_current_replicas",
        "baton_autoscaler_scale_actions_total",
    }
    for series in wanted:
        name, kind = family_of(series)
        assert exposed.get(name) == kind, series


class LivePair:
    def __init__(self, log_dir: Path) -> None:
        self.producer = ServerProcess(
            MODEL, *ENGINE_ARGS, "--kv-role", "producer", "--kv-transfer-port", str(free_port()),
            log_path=log_dir / "producer.log",
        )  # fmt: skip
        try:
            self.consumer = ServerProcess(
                MODEL, *ENGINE_ARGS, "--kv-role", "consumer", log_path=log_dir / "consumer.log"
            )
        except BaseException:
            self.producer.stop(signal.SIGKILL, timeout=10)
            raise
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self._router_log = open(log_dir / "router.log", "wb")
        self.router = subprocess.Popen(
            [
                BATON_ROUTER, "--host", "127.0.0.1", "--port", str(self.router_port), "--model", NAME,
                "--prefill", self.producer.url, "--decode", self.consumer.url, "--no-kv-events",
            ],
            stdout=self._router_log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def router_ready(self) -> bool:
        if self.router.poll() is not None:
            raise AssertionError(f"baton-router exited with {self.router.returncode}")
        try:
            return httpx.get(f"{self.router_url}/ready", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(20)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        self._router_log.close()
        for server in (self.consumer, self.producer):
            server.stop(signal.SIGTERM, timeout=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePair]:
    mp = pytest.MonkeyPatch()
    mp.setenv(contract.ENV_KV_TRANSFER_KEY, "dashboard-test-key")
    mp.delenv(contract.ENV_POD_IP, raising=False)
    pair = LivePair(tmp_path_factory.mktemp("dashboard"))
    try:
        yield pair
    finally:
        pair.stop()
        mp.undo()


@pytest.mark.slow
@pytest.mark.model
def test_every_queried_series_is_exposed_by_live_engines_and_router(live: LivePair) -> None:
    wait_for(live.router_ready, 60, message="the router to see both pods")
    body = {"model": NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    response = httpx.post(f"{live.router_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]

    def kv_bytes_seen() -> bool:
        text = httpx.get(f"{live.consumer.url}/metrics", timeout=30).text
        return f'{contract.M_KV_TRANSFER_BYTES}{{direction="received"' in text

    wait_for(kv_bytes_seen, 30, message="the consumer's KV-transfer bytes on /metrics")
    exposed: dict[str, str] = {}
    for url in (live.producer.url, live.consumer.url, live.router_url):
        exposed |= families(httpx.get(f"{url}/metrics", timeout=30).text)
    wanted = sorted(s for s in queried_series(load()) if not s.startswith(AUTOSCALER_PREFIX))
    missing = [s for s in wanted if exposed.get(family_of(s)[0]) != family_of(s)[1]]
    assert missing == []
    assert wanted == sorted(
        [
            contract.M_REQUESTS_WAITING,
            contract.M_REQUESTS_RUNNING,
            contract.M_KV_USAGE,
            contract.M_TTFT + "_bucket",
            contract.M_ITL + "_bucket",
            contract.M_ROUTER_TTFB_SECONDS + "_bucket",
            contract.M_ROUTER_REQUESTS,
            contract.M_KV_TRANSFER_BYTES,
            contract.M_KV_TRANSFER_SECONDS + "_bucket",
            contract.M_KV_TRANSFER_FAILURES,
            contract.M_KV_LEASES_EXPIRED,
            contract.M_ROUTER_FALLBACKS,
            contract.M_ROUTER_ENDPOINTS,
        ]
    )
