"""Soak: minutes of mixed valid, invalid, cancelled and streaming requests against one real
``baton-engine serve``, measuring both processes' memory over time and what is left at the end.

Workers send a fixed, seeded mix: plain and streamed completions and chats, ``n > 1`` with
logprobs, stop strings, streams dropped after their first chunks, requests dropped before their
answer, deadlines that expire (408), JSON-schema answers (``n=2``, each choice checked) and
constrained streams dropped midway, and bad requests (int32 overflow, NaN, nesting, an image,
an unknown model, a body over the size limit, an unsatisfiable schema). Every
``--sample-seconds`` the server's and the engine core's RSS (``/proc/<pid>/status``) are
recorded. At the end the engine must go idle: no request waiting or running, no KV block or
grammar in use, nothing in flight in the server.

The reference is the run's own start: RSS after the warm-up, the memory growth between the
second and the last tenth of the run, and its rate past the first tenth (least squares, MiB/min;
a leak grows linearly, a flat process does not).

Run: ``python -m bench.soak --json [--minutes 30]`` (one JSON object on the last line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
SERVER_ARGS = (
    "--num-kv-blocks", "512",
    "--max-model-len", "1024",
    "--max-num-seqs", "32",
    "--max-num-batched-tokens", "1024",
    "--max-request-body-bytes", str(2 * 1024 * 1024),
)  # fmt: skip
BODY_LIMIT = 2 * 1024 * 1024
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
)


@dataclass
class SoakConfig:
    model: str = DEFAULT_MODEL
    served_name: str = "soak"
    seconds: float = 30 * 60.0
    concurrency: int = 8
    sample_seconds: float = 10.0
    seed: int = 0
    extra_server_args: tuple[str, ...] = ()
    log_path: Path | None = None


@dataclass
class Tally:
    by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def record(self, kind: str, status: int | str, expected: tuple[int | str, ...]) -> None:
        self.by_kind[kind] += 1
        self.statuses[str(status)] += 1
        if status not in expected and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: got {status}, expected one of {expected}")


# ------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def running_server(config: SoakConfig) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`baton-engine serve` on a free loopback port until ready; stopped by pid (SIGTERM)."""
    port = _free_port()
    binary = str(Path(sys.executable).with_name("baton-engine"))
    argv = [
        binary, "serve", "--model", config.model, "--served-model-name", config.served_name,
        "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS, *config.extra_server_args,
    ]  # fmt: skip
    log_path = config.log_path or Path(tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            with httpx.Client(base_url=url, timeout=30.0) as client:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"server not ready after 600 s; see {log_path}")
                    with contextlib.suppress(httpx.TransportError):
                        if client.get("/ready").status_code == 200:
                            break
                    time.sleep(0.2)
            yield process, url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


# ------------------------------------------------------------------------------ the mix


def _bad_bodies(model: str) -> list[tuple[str, bytes, int]]:
    """(name, raw body, expected status)."""

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "prompt": "hi", "max_tokens": 4, **fields}).encode()

    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    return [
        ("top_k_int32_overflow", body(top_k=2**31), 400),
        ("temperature_nan", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % model.encode(), 400),
        ("nested", b"[" * 5000, 400),
        ("not_json", b'{"model": ', 400),
        ("unknown_model", body(model="gpt-17"), 404),
        ("token_out_of_range", body(prompt=[1, 2, 10**9]), 400),
        ("image_part", json.dumps({"model": model, "messages": [image]}).encode(), 400),
        ("over_the_body_limit", body(prompt="x" * (BODY_LIMIT + 10)), 413),
        ("too_long", body(prompt="Hello " * 4000), 400),
        (
            "unsatisfiable_schema",
            body(response_format=_schema_format({"type": "integer", "minimum": 2, "maximum": 1})),
            400,
        ),
    ]


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
"""The soak's structured answers: bounded, so that they end (``stop``) well within max_tokens."""


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "soak", "schema": schema, "strict": True}}


def _valid_under_schema(text: str) -> bool:
    """`text` is a JSON document of `SCHEMA`'s shape (checked by hand: the bench needs no
    jsonschema)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "tags"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 8
        and isinstance(doc["tags"], list)
        and len(doc["tags"]) <= 3
        and all(tag in ("a", "b", "c") for tag in doc["tags"])
    )


class Mix:
    def __init__(self, client: httpx.AsyncClient, model: str, tally: Tally) -> None:
        self.client = client
        self.model = model
        self.tally = tally
        self.bad = _bad_bodies(model)

    def kinds(self) -> list[tuple[Callable[[random.Random], Awaitable[None]], int]]:
        """Each request kind with its weight in the mix."""
        return [
            (self.completion, 4),
            (self.chat_stream, 4),
            (self.chat_n_logprobs, 1),
            (self.stop_string, 1),
            (self.dropped_stream, 2),
            (self.dropped_request, 1),
            (self.deadline, 1),
            (self.bad_request, 3),
            (self.structured, 2),
            (self.dropped_structured_stream, 1),
        ]

    async def completion(self, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 32)}
        response = await self.client.post("/v1/completions", json=body)
        self.tally.record("completion", response.status_code, (200,))

    async def chat_stream(self, rng: random.Random) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(4, 32),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            done = False
            async for line in response.aiter_lines():
                done = done or line == "data: [DONE]"
        self.tally.record("chat_stream", response.status_code if done else "no [DONE]", (200,))

    async def chat_n_logprobs(self, rng: random.Random) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": 8,
            "n": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "temperature": 1.0,
        }
        response = await self.client.post("/v1/chat/completions", json=body)
        self.tally.record("chat_n_logprobs", response.status_code, (200,))

    async def stop_string(self, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 32, "stop": [" ", "\n"]}
        response = await self.client.post("/v1/completions", json=body)
        self.tally.record("stop_string", response.status_code, (200,))

    async def dropped_stream(self, rng: random.Random) -> None:
        """Read the first chunks of a long stream, then hang up."""
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "stream": True}
        body["ignore_eos"] = True
        self.tally.record("dropped_stream", await self._hang_up_early(body, rng), (200,))

    async def _hang_up_early(self, body: dict[str, object], rng: random.Random) -> int:
        """Stream a completion, read its first 1-4 chunks, close the connection; the status."""
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= rng.randint(1, 4):
                    break
        return response.status_code

    async def dropped_request(self, rng: random.Random) -> None:
        """A non-streamed request whose client goes away before the answer."""
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
        try:
            async with asyncio.timeout(rng.uniform(0.05, 0.5)):
                response = await self.client.post("/v1/completions", json=body)
            self.tally.record("dropped_request", response.status_code, (200,))  # finished first
        except TimeoutError:
            self.tally.record("dropped_request", "dropped", ("dropped",))

    async def deadline(self, rng: random.Random) -> None:
        body = {
            "model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 500, "ignore_eos": True,
            "timeout": 0.05,
        }  # fmt: skip
        response = await self.client.post("/v1/completions", json=body)
        self.tally.record("deadline", response.status_code, (408, 400))  # 400: prompt + 500 > max_model_len

    async def structured(self, rng: random.Random) -> None:
        """A JSON-schema answer, n=2, sampled: each choice must be a valid document."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "response_format": _schema_format(SCHEMA),
            "max_tokens": 120,
            "n": 2,
            "temperature": 1.0,
        }
        response = await self.client.post("/v1/chat/completions", json=body)
        status: int | str = response.status_code
        if status == 200:
            for choice in response.json()["choices"]:
                if choice["finish_reason"] != "stop" or not _valid_under_schema(choice["message"]["content"]):
                    status = f"invalid document ({choice['finish_reason']}): {choice['message']['content']!r}"
        self.tally.record("structured", status, (200,))

    async def dropped_structured_stream(self, rng: random.Random) -> None:
        """A constrained stream (a long string) hung up on after its first chunks."""
        body = {
            "model": self.model,
            "prompt": rng.choice(PROMPTS),
            "response_format": _schema_format({"type": "string", "minLength": 300}),
            "max_tokens": 200,
            "stream": True,
        }
        self.tally.record("dropped_structured_stream", await self._hang_up_early(body, rng), (200,))

    async def bad_request(self, rng: random.Random) -> None:
        name, raw, expected = rng.choice(self.bad)
        path = "/v1/chat/completions" if name == "image_part" else "/v1/completions"
        response = await self.client.post(path, content=raw, headers={"content-type": "application/json"})
        self.tally.record(f"bad:{name}", response.status_code, (expected,))


# ------------------------------------------------------------------------------ the run


async def _worker(mix: Mix, rng: random.Random, stop_at: float) -> None:
    kinds = mix.kinds()
    population = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    while time.monotonic() < stop_at:
        kind = rng.choices(population, weights)[0]
        try:
            await kind(rng)
        except httpx.HTTPError as exc:
            mix.tally.record(kind.__name__, f"transport error {type(exc).__name__}", ())


async def _sampler(
    server_pid: int, core_pid: int, started: float, every: float, samples: list[dict[str, float]]
) -> None:
    while True:
        server, core = rss_bytes(server_pid), rss_bytes(core_pid)
        samples.append(
            {
                "t_s": round(time.monotonic() - started, 1),
                "server_rss_mib": round((server or 0) / 2**20, 1),
                "core_rss_mib": round((core or 0) / 2**20, 1),
            }
        )
        await asyncio.sleep(every)


def _growth(samples: list[dict[str, float]], key: str) -> float | None:
    """RSS at the last tenth minus at the second tenth of the run (MiB): past the warm-up."""
    if len(samples) < 10:
        return None
    tenth = len(samples) // 10
    early = samples[tenth][key]
    late = max(s[key] for s in samples[-tenth:])
    return round(late - early, 1)


def _slope_per_minute(samples: list[dict[str, float]], key: str) -> float | None:
    """Least-squares slope of `key` over time past the first tenth of the run (MiB/min): a
    leak's rate, ~0 for a flat process (the warm-up's caches fill in the first tenth)."""
    if len(samples) < 10:
        return None
    tail = samples[len(samples) // 10 :]
    ts = [s["t_s"] / 60.0 for s in tail]
    ys = [s[key] for s in tail]
    mean_t, mean_y = sum(ts) / len(ts), sum(ys) / len(ys)
    spread = sum((t - mean_t) ** 2 for t in ts)
    if spread == 0:
        return None
    return round(sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys, strict=True)) / spread, 2)


async def _idle_state(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    """The first stats snapshot with nothing queued, running or in flight (or the last one)."""
    deadline = time.monotonic() + timeout
    while True:
        stats: dict[str, Any] = (await client.get("/debug/stats")).json()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["in_flight"] == 0
        if (idle and stats["num_used_kv_blocks"] == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def _soak(config: SoakConfig, server_pid: int, url: str) -> dict[str, Any]:
    tally = Tally()
    limits = httpx.Limits(
        max_connections=config.concurrency * 2, max_keepalive_connections=config.concurrency
    )
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        stats = (await client.get("/debug/stats")).json()
        core_pid = int(stats["core_pid"])
        mix = Mix(client, config.served_name, tally)
        warm_rng = random.Random(config.seed - 1)
        for kind, _ in mix.kinds():  # warm-up: every path once, before the reference sample
            await kind(warm_rng)
        started = time.monotonic()
        samples: list[dict[str, float]] = []
        sampler = asyncio.create_task(_sampler(server_pid, core_pid, started, config.sample_seconds, samples))
        stop_at = started + config.seconds
        workers = [
            _worker(mix, random.Random(config.seed * 1000 + i), stop_at) for i in range(config.concurrency)
        ]
        await asyncio.gather(*workers)
        elapsed = time.monotonic() - started
        end = await _idle_state(client, timeout=60.0)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        server_rss, core_rss = rss_bytes(server_pid), rss_bytes(core_pid)
        samples.append(
            {
                "t_s": round(time.monotonic() - started, 1),
                "server_rss_mib": round((server_rss or 0) / 2**20, 1),
                "core_rss_mib": round((core_rss or 0) / 2**20, 1),
            }
        )
        health = (await client.get("/health")).status_code
        ready = (await client.get("/ready")).status_code
    total = sum(tally.by_kind.values())
    return {
        "bench": "soak",
        "seconds": round(elapsed, 1),
        "concurrency": config.concurrency,
        "requests": total,
        "requests_per_s": round(total / elapsed, 2) if elapsed else None,
        "by_kind": dict(sorted(tally.by_kind.items())),
        "statuses": dict(sorted(tally.statuses.items())),
        "unexpected": tally.unexpected,
        "end": {
            "num_used_kv_blocks": end["num_used_kv_blocks"],
            "num_kv_blocks": end["num_kv_blocks"],
            "num_grammar_requests": end["num_grammar_requests"],
            "num_running": end["num_running"],
            "num_waiting": end["num_waiting"],
            "in_flight": end["in_flight"],
            "health": health,
            "ready": ready,
        },
        "rss_mib": {
            "server_start": samples[0]["server_rss_mib"],
            "server_end": samples[-1]["server_rss_mib"],
            "server_max": max(s["server_rss_mib"] for s in samples),
            "server_growth_after_warmup": _growth(samples, "server_rss_mib"),
            "server_growth_mib_per_min": _slope_per_minute(samples, "server_rss_mib"),
            "core_start": samples[0]["core_rss_mib"],
            "core_end": samples[-1]["core_rss_mib"],
            "core_max": max(s["core_rss_mib"] for s in samples),
            "core_growth_after_warmup": _growth(samples, "core_rss_mib"),
            "core_growth_mib_per_min": _slope_per_minute(samples, "core_rss_mib"),
        },
        "rss_samples": samples,
    }


def quick_config(tiny_model: Path, log_path: Path | None = None) -> SoakConfig:
    """The smoke run's configuration: 20 s against a tiny random chat model."""
    return SoakConfig(
        model=str(tiny_model),
        seconds=20.0,
        concurrency=4,
        sample_seconds=2.0,
        extra_server_args=("--dtype", "float32"),
        log_path=log_path,
    )


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Start a server, soak it, stop it; the result (see the module docstring)."""
    with running_server(config) as (process, url):
        result = asyncio.run(_soak(config, process.pid, url))
    result["server_exit_code"] = process.returncode
    result["config"] = {
        "model": config.model,
        "server_args": list(SERVER_ARGS + config.extra_server_args),
        "sample_seconds": config.sample_seconds,
        "seed": config.seed,
        "python": platform.python_version(),
        "httpx": httpx.__version__,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="How long to soak (default: 30).")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"Model reference (default: {DEFAULT_MODEL}).")
    parser.add_argument("--concurrency", type=int, default=8, help="Concurrent clients (default: 8).")
    parser.add_argument(
        "--sample-seconds", type=float, default=10.0, help="RSS sampling period (default: 10)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the request mix (default: 0).")
    parser.add_argument(
        "--log", type=Path, default=None, help="Where the server's log goes (default: a temp file)."
    )
    parser.add_argument("--json", action="store_true", help="Print only the JSON result.")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="20 s against a tiny random chat model, 4 clients, RSS every 2 s: a smoke run "
        "(tests/server/test_soak.py runs this configuration)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        if args.quick:
            from baton_support.tiny_models import CHAT

            CHAT.save(Path(tmp) / "tiny-chat")
            config = quick_config(Path(tmp) / "tiny-chat", args.log)
        else:
            config = SoakConfig(
                model=args.model,
                seconds=args.minutes * 60.0,
                concurrency=args.concurrency,
                sample_seconds=args.sample_seconds,
                seed=args.seed,
                log_path=args.log,
            )
        result = {**run_soak(config), "quick": args.quick}
    if not args.json:
        rss, end = result["rss_mib"], result["end"]
        print(
            f"{result['requests']} requests in {result['seconds']} s; "
            f"unexpected: {len(result['unexpected'])}; "
            f"KV blocks in use at the end: {end['num_used_kv_blocks']}; "
            f"grammars left: {end['num_grammar_requests']}; "
            f"server RSS {rss['server_start']} -> {rss['server_end']} MiB "
            f"({rss['server_growth_mib_per_min']} MiB/min), "
            f"core RSS {rss['core_start']} -> {rss['core_end']} MiB "
            f"({rss['core_growth_mib_per_min']} MiB/min)"
        )
    print(json.dumps(result))
    clean = (
        not result["unexpected"]
        and result["end"]["num_used_kv_blocks"] == 0
        and result["end"]["num_grammar_requests"] == 0
        and result["end"]["in_flight"] == 0
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
