"""The router's added latency on streamed answers.

Three processes: a fixed-rate streaming upstream (``bench.router_upstream``), the real
``baton-router`` CLI in disaggregated mode (the upstream plays both prefill and decode pod), and
this client. The client runs ``--streams`` concurrent streams (starts spread over one event
interval) straight to the upstream, then the same through the router, alternating for
``--rounds`` rounds (running both sets at once made the Python client the bottleneck). Each SSE
event carries the upstream's send time; its latency is receive time minus send time. The added
latency is the routed percentile minus the direct percentile.

Run: ``python -m bench.router --json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from baton_support.ports import free_port

_STAMP = re.compile(rb'"t":(\d+)')
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}


@contextmanager
def _process(argv: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{argv} exited with {process.returncode}")
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv} did not become healthy")
            time.sleep(0.05)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _stream(client: httpx.AsyncClient, url: str, delay: float, chunk_ms: list[float]) -> None:
    await asyncio.sleep(delay)
    buffer = b""
    async with client.stream("POST", url, json=BODY) as response:
        response.raise_for_status()
        async for data in response.aiter_raw():
            now = time.monotonic_ns()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                stamp = _STAMP.search(event)
                if stamp is not None:
                    chunk_ms.append((now - int(stamp.group(1))) / 1e6)


async def _phase(
    client: httpx.AsyncClient, url: str, streams: int, interval_s: float
) -> tuple[list[float], list[float]]:
    """``streams`` concurrent streams, their starts spread over one event interval; returns the
    event latencies and one entry per stream that failed (counted, not fatal)."""
    chunk_ms: list[float] = []
    results = await asyncio.gather(
        *(_stream(client, url, i * interval_s / streams, chunk_ms) for i in range(streams)),
        return_exceptions=True,
    )
    failed = [1.0 for r in results if isinstance(r, BaseException)]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, httpx.HTTPError):
            raise r
    return chunk_ms, failed


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _router_stack() -> str:
    from importlib.metadata import PackageNotFoundError, version

    names = []
    for package in ("aiohttp", "uvicorn", "uvloop", "httptools", "fastapi"):
        try:
            names.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            names.append(f"{package} -")
    return ", ".join(names)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(
    direct_url: str, router_url: str, streams: int, rounds: int, interval_s: float, router_pid: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        "direct": [],
        "router": [],
        "cpu": [],
        "direct_errors": [],
        "router_errors": [],
    }
    # keep-alive below uvicorn's 5 s, so no request goes out on a socket the server is closing
    limits = httpx.Limits(
        max_connections=4 * streams, max_keepalive_connections=4 * streams, keepalive_expiry=1.0
    )
    async with httpx.AsyncClient(limits=limits, timeout=60, trust_env=False) as client:
        await _phase(client, direct_url, streams, interval_s)  # warm-up: connections, imports, caches
        await _phase(client, router_url, streams, interval_s)
        for _ in range(rounds):
            for name, url in (("direct", direct_url), ("router", router_url)):
                cpu_before = _cpu_seconds(router_pid)
                chunks, errors = await _phase(client, url, streams, interval_s)
                out[name] += chunks
                out[name + "_errors"] += errors
                if name == "router":
                    out["cpu"].append((_cpu_seconds(router_pid) - cpu_before) / max(1, len(chunks)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--chunks", type=int, default=100, help="SSE events per stream")
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between events of one stream")
    p.add_argument("--rounds", type=int, default=5, help="direct and routed phases, alternating")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--quick", action="store_true", help="4 streams x 20 events, one round: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.streams, args.chunks, args.interval_ms, args.rounds = 4, 20, 5.0, 1

    upstream_port, router_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{upstream_port}"
    router = f"http://127.0.0.1:{router_port}"
    path = "/v1/chat/completions"
    upstream_cmd = [
        sys.executable,
        "-m",
        "bench.router_upstream",
        "--port",
        str(upstream_port),
        "--interval-ms",
        str(args.interval_ms),
        "--chunks",
        str(args.chunks),
    ]
    router_cmd = [
        sys.executable,
        "-m",
        "baton_engine.router.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--prefill",
        upstream,
        "--decode",
        upstream,
        "--log-level",
        "warning",
    ]
    env_key = os.environ.pop("BATON_ROUTER_API_KEY", None)  # the bench client sends no key
    try:
        with _process(upstream_cmd, upstream + "/health"), _process(router_cmd, router + "/health") as rp:
            samples = asyncio.run(
                _measure(
                    upstream + path, router + path, args.streams, args.rounds, args.interval_ms / 1000, rp.pid
                )
            )
    finally:
        if env_key is not None:
            os.environ["BATON_ROUTER_API_KEY"] = env_key

    direct, routed = samples["direct"], samples["router"]
    result = {
        "bench": "router",
        "quick": args.quick,
        "mode": "disaggregated",
        "streams": args.streams,
        "interval_ms": args.interval_ms,
        "chunks_per_stream": args.chunks,
        "rounds": args.rounds,
        "samples_direct": len(direct),
        "samples_router": len(routed),
        "failed_streams_direct": len(samples["direct_errors"]),
        "failed_streams_router": len(samples["router_errors"]),
        "direct_chunk_ms_p50": round(_pct(direct, 0.50), 3),
        "direct_chunk_ms_p99": round(_pct(direct, 0.99), 3),
        "router_chunk_ms_p50": round(_pct(routed, 0.50), 3),
        "router_chunk_ms_p99": round(_pct(routed, 0.99), 3),
        "added_latency_ms_p50": round(_pct(routed, 0.50) - _pct(direct, 0.50), 3),
        "added_latency_ms_p99": round(_pct(routed, 0.99) - _pct(direct, 0.99), 3),
        "added_latency_ms_mean": round(statistics.fmean(routed) - statistics.fmean(direct), 3),
        "router_cpu_us_per_chunk": round(statistics.fmean(samples["cpu"]) * 1e6, 1),
        "target_added_latency_ms_p50": 2.0,
        "python": platform.python_version(),
        "client": f"httpx {httpx.__version__}",
        "router_stack": _router_stack(),
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
