"""Real `baton-router` processes in front of real `baton-engine serve` processes, on 127.0.0.1.

Everything here is started as a subprocess and stopped by pid; metrics are read from the
processes' own /metrics, KV events from the engines' replay sockets.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from baton_engine import contract
from baton_engine.prefix.wire import WireBlockStored, decode_batch, encode_sequence, parse_replay_answer
from baton_support.wait import wait_for
from tests.server.server_process import (
    LoopbackProcess,
    ServerProcess,
    child_pids,
    free_port,
    pid_alive,
)

BATON_ROUTER = str(Path(sys.executable).with_name("baton-router"))
MODEL = "builtin:smollm2-135m-instruct"
NAME = "smollm2"
BLOCK_SIZE = 16
KEY = "router-e2e-deployment-key"
ENGINE_ARGS = ("--dtype", "float32", "--served-model-name", NAME, "--block-size", str(BLOCK_SIZE))


def metric(url: str, name: str, *, absent: float | None = None, **labels: str) -> float:
    """The sum of `name`'s samples (matching `labels`) on `url`/metrics; `absent` if there are none
    (a labelled counter has no sample before its first increment), else an AssertionError."""
    text = httpx.get(f"{url}{contract.PATH_METRICS}", timeout=10.0).text
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    if not found:
        if absent is not None:
            return absent
        raise AssertionError(f"{name}{labels} not in {url}/metrics")
    return float(sum(found))


class RouterProcess(LoopbackProcess):
    label = "router"

    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        port = free_port()
        argv = [BATON_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--model", NAME, *args]
        super().__init__(argv, port, log_path, http_timeout=120.0, env=env)
        self.wait_ready(180, interval=0.1, stop_signal=signal.SIGTERM)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        return super().stop(sig, timeout)


def start_engine(*args: str, log_path: Path) -> ServerProcess:
    return ServerProcess(MODEL, *ENGINE_ARGS, *args, log_path=log_path)


def stop_engines(engines: Sequence[ServerProcess]) -> None:
    """SIGKILL each server by pid, then wait for its engine-core child (it exits when its parent goes)."""
    for engine in engines:
        children = child_pids(engine.pid) if engine.proc.poll() is None else []
        engine.stop(signal.SIGKILL, timeout=10)
        for pid in children:
            wait_for(lambda pid=pid: not pid_alive(pid), timeout=20, message=f"engine core {pid} to exit")


def kv_event_ports() -> tuple[str, ...]:
    return ("--kv-events", "--kv-events-port", str(free_port()), "--kv-events-replay-port", str(free_port()))


def port_of(args: Sequence[str], flag: str) -> int:
    return int(args[list(args).index(flag) + 1])


def replayed_block_stored(replay_port: int, timeout_s: float = 5.0) -> tuple[list[WireBlockStored], int]:
    """Every BlockStored event the engine still buffers, in order (replay from sequence 0), and the
    sequence number of the last batch (-1: none)."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    stored: list[WireBlockStored] = []
    last_seq = -1
    try:
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", encode_sequence(0)))
        while True:
            if not dealer.poll(int(timeout_s * 1000)):
                raise AssertionError(f"no replay answer from port {replay_port} within {timeout_s} s")
            seq, payload = parse_replay_answer(dealer.recv_multipart())
            if seq == -1:
                return stored, last_seq
            last_seq = seq
            stored += [e for e in decode_batch(payload).events if isinstance(e, WireBlockStored)]
    finally:
        dealer.close(linger=0)


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def complete(url: str, prompt: str | list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def counter(url: str, name: str, **labels: str) -> float:
    """A counter's value: 0 until its first increment creates the sample."""
    return metric(url, name, absent=0.0, **labels)
