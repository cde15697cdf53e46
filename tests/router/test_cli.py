"""The real ``baton-router`` command in its own process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from baton_support.ports import free_port
from baton_support.wait import wait_for


@pytest.fixture
def router_process(start_engine) -> Iterator[tuple[str, object]]:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0")
    port = free_port()
    env = {**os.environ, "BATON_ROUTER_API_KEY": "k1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton_engine.router.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefill",
            prefill_url,
            "--decode",
            decode_url,
            "--log-level",
            "warning",
            "--prefix-hash",
            "vllm-sha256-cbor",
        ],
        env={**env, "PYTHONHASHSEED": "0"},
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, "router exited"
        try:
            return httpx.get(url + "/health", timeout=30).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, timeout=120, message="baton-router to answer /health")  # imports under load
        yield url, decode
    finally:
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)


def test_cli_serves_requests_with_the_api_key_from_the_environment(router_process) -> None:
    url, decode = router_process
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 401
    response = httpx.post(
        url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k1"}, timeout=30
    )
    assert response.status_code == 200
    assert len(decode.posts()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no pods: give --prefill and --decode URLs"),
        (["--decode", "http://a:1"], "--mode disaggregated needs --prefill URLs"),
        (
            ["--mode", "aggregated", "--engine", "a:1", "--decode", "b:1"],
            "--mode aggregated does not use decode pods",
        ),
        (["--engine", "a:1", "--k8s-deployment", "d"], "choose static URLs"),
        (["--prefill", "a:1", "a:1", "--decode", "b:1"], "prefill endpoints: http://a:1 given twice"),
        (["--prefill", "a:1", "--decode", "b:1", "--block-size", "0"], "block_size: must be positive"),
        (
            ["--mode", "aggregated", "--engine", "a:1", "--tokenizer", "/nonexistent/model"],
            "--tokenizer /nonexistent/model: model '/nonexistent/model' not found",
        ),
        (
            ["--mode", "aggregated", "--engine", "a:1", "--tokenizer", "builtin:nope"],
            "--tokenizer builtin:nope: unknown builtin model 'nope'",
        ),
        (["--prefill", "a:1#kv-events=x", "--decode", "b:1"], "port 'kv-events=x' is not NAME=PORT"),
        (
            ["--prefill", "a:1", "--decode", "b:1", "--prefix-weight", "-2"],
            "prefix_weight: must be a finite number >= 0, got -2.0",
        ),
        (
            ["--prefill", "a:1", "--decode", "b:1", "--load-weight", "inf"],
            "load_weight: must be a finite number >= 0, got inf",
        ),
    ],
)
def test_cli_rejects_bad_flags(argv: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "baton_engine.router.cli", *argv], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert message in out.stderr
