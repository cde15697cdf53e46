"""Disaggregation against aggregation: the same offered load through the real router.

Two layouts of two engines each, one after the other, behind ``baton-router`` (its own process,
static discovery on 127.0.0.1):

* ``disaggregated``: one prefill engine and one decode engine; every request's prompt is
  prefilled on the first and its KV blocks pulled over Baton's KV transfer by the second, which
  decodes;
* ``aggregated``: two engines doing both, the router choosing one per request.

Every engine runs ``baton-engine serve`` with the flags the operator renders for that role's pods
(`baton_operator.builders.engine.engine_args` on one `InferenceDeploymentSpec` per layout), the
router with the operator's router flags (`router_args`); only what a pod gets from Kubernetes is
replaced: the loopback address, a free port per server, static discovery instead of the pod
watch (with the block size and prefix hash the router otherwise reads from pod annotations),
and the engines' KV-cache size where given (``--num-kv-blocks``).

Load (open loop, seeded): Poisson arrivals at each ``--rates`` value (requests per second) over
``--duration`` seconds per rate (``rate x duration`` requests on average; ``arrived_rps`` is the
drawn count over the duration), random token-id
prompts of ``--prompt-tokens MIN,MAX`` tokens (uniform), ``--output-tokens`` tokens each (EOS
ignored), streamed from ``/v1/completions``. The same prompts and arrival times go to both
layouts. An asyncio httpx client in this process holds every stream open and records each
request's time to first token (TTFT) and the gap before every later token (ITL: a chunk's first
token after the gap since the previous chunk, the chunk's other tokens after none; the model's
word-level tokenizer makes each token one word, so a chunk's words are its tokens, and
``tokens_per_chunk`` says how often tokens came together). Not aiperf: the GPU machine has no aiperf
venv, and per-request records are what the SLO needs.

Per rate and layout: TTFT and ITL p50/p99, output tokens per second over the rate's window (its
duration, or until the last answer when that came later), completed/errors, and goodput under the
SLO (``--slo-ttft-s``, ``--slo-itl-ms``): a request meets it when it completed, its TTFT is within
the first and its mean gap between tokens (TPOT, DistServe's and vLLM's goodput criterion) within
the second; ``goodput_fraction`` of the requests sent and ``goodput_rps`` per second of the window.
The reference is the aggregated layout in the same run; ``offered_output_tokens_per_s`` (the drawn
requests x output tokens over the duration) is what an open-loop load asks for: the throughput
ceiling while the servers keep up. P/D's KV transfer is read from the engines' metrics (bytes the
decode engine pulled, its failed pulls and the prefill engine's expired leases: each would mean a
recomputed prompt, not a P/D figure) and the router's fallbacks. ``verdict`` per rate says which
layout wins on what (within 5 %: a tie).

Devices: ``--device cuda`` runs the 8B shape (Llama-3.1-8B, random bf16 weights written once as a
Hugging Face folder) with each engine pinned to its own GPU (CUDA_VISIBLE_DEVICES); it refuses to
run on fewer than 2 GPUs unless ``--share-gpu`` puts both engines on GPU 0 with the memory split
(a check of the path, not the figure: the output says so). ``--device cpu`` runs a tiny random
Llama, each engine with ``--threads`` OpenMP threads (1: two engines share the 2 cores of this
machine): a check of the whole path and of the figures' shape, not a performance result.
Defaults per device: prompts 2048-8192 tokens, 256 output, SLO 2 s / 50 ms on the GPU; tiny sizes
and a CPU-sized SLO (1 s / 100 ms) on the CPU.

Every process it starts (engines with their engine cores, the router) runs in its own session and
is stopped by process group at the end, on failure (an engine that does not start) and on
Ctrl-C or SIGTERM. A layout that fails is named in ``failed_layouts`` with its error, the other
layout still runs, and the exit status is 1.

Run: ``python -m bench.pd --json`` (CPU), ``python -m bench.pd --device cuda --json`` (two GPUs;
on the GPU machine: ``bash scripts/device/bench-pd.sh``). ``--quick``: a smoke run of seconds.
``--table FILE`` prints a recorded result as the markdown table bench/RESULTS.md shows.
Results: bench/RESULTS.md (bench.pd).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np

from baton_engine import contract
from baton_support.ports import free_port
from baton_support.wait import wait_for
from bench.serving import process_table, stop_group

LAYOUTS = ("disaggregated", "aggregated")
SERVED_NAME = "pd-bench"
BLOCK_SIZE = 16
#: Random prompt ids start here (none of the word-level tokenizer's ids is special).
FIRST_TOKEN = 1
START_TIMEOUT_S = 900.0  # two 8B engines loading, compiling and capturing graphs at once
TIE = 0.05


@dataclass(frozen=True)
class Settings:
    """One run; the defaults are the CPU shape check, `GPU` the figure's settings."""

    device: str = "cpu"
    """cpu | cuda (the engines' ``--device``)."""
    share_gpu: bool = False
    """cuda: both engines on GPU 0, each with its share of the memory (not the figure)."""
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    """Offered load, requests per second (Poisson arrivals)."""
    duration_s: float = 15.0
    """Seconds of arrivals per rate (rate x duration requests on average)."""
    prompt_tokens: tuple[int, int] = (64, 256)
    """Prompt lengths, MIN and MAX tokens (uniform)."""
    output_tokens: int = 32
    """Tokens generated per request (EOS ignored)."""
    slo_ttft_s: float = 1.0
    """SLO: longest time to first token."""
    slo_itl_ms: float = 100.0
    """SLO: longest mean gap between a request's tokens (TPOT)."""
    layouts: tuple[str, ...] = LAYOUTS
    """The layouts run, in order (both: a verdict per rate)."""
    threads: int = 1
    """CPU: OpenMP threads of each engine core."""
    num_kv_blocks: int | None = 512
    """Each engine's KV cache in blocks; None: the engine's default (on a GPU: what
    ``gpu_memory_utilization`` leaves)."""
    max_num_batched_tokens: int = 2048
    """Tokens per engine step (the operator's default): a long prompt is prefilled in chunks of it,
    interleaved with the running requests' decode steps on an aggregated engine."""
    seed: int = 7
    """Seeds the arrivals and prompts (per rate: the same for every layout)."""
    warmup_requests: int = 4
    """Requests through the router before the first rate (half of the shortest prompt length,
    half of the longest), not measured."""
    drain_timeout_s: float = 600.0
    """How long the requests of one rate may take to finish after its last arrival."""
    quick: bool = False
    """A smoke run (``--quick``): never a figure."""


CPU = Settings()
CPU_QUICK = dataclasses.replace(
    CPU, rates=(2.0,), duration_s=2.0, prompt_tokens=(32, 64), output_tokens=8, warmup_requests=2,
    num_kv_blocks=128, quick=True,
)  # fmt: skip
GPU = Settings(
    device="cuda",
    rates=(0.5, 1.0, 2.0),
    duration_s=30.0,
    prompt_tokens=(2048, 8192),
    output_tokens=256,
    slo_ttft_s=2.0,
    slo_itl_ms=50.0,
    threads=0,
    num_kv_blocks=None,
)
GPU_QUICK = dataclasses.replace(
    GPU, rates=(1.0,), duration_s=4.0, prompt_tokens=(512, 1024), output_tokens=32, warmup_requests=2,
    quick=True,
)  # fmt: skip
#: --share-gpu: each engine's share of the one GPU's memory (weights, KV cache, activations, graphs).
SHARED_GPU_FRACTION = 0.42
GPU_SPARE_BYTES = 8 * 2**30  # activations of a 2048-token step, CUDA graphs, the allocator's slack


def progress(message: str) -> None:
    print(f"[pd {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the model ---------------------------------------------------------------------------------------


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json of `vocab_size` words ``w0 .. w{n-1}`` (the server needs one to
    stream text; one id decodes to one word, so the random-weight model's text costs little)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def build_cpu_model(directory: Path) -> int:
    """A tiny random Llama (float32) with its tokenizer; returns its vocabulary size."""
    from baton_support.tiny_models import TinyModel

    vocab = 512
    TinyModel(
        hidden_size=64, num_layers=2, vocab_size=vocab, max_positions=1024, dtype="float32", seed=11
    ).save(directory)
    write_word_tokenizer(directory, vocab)
    return vocab


def build_gpu_model(directory: Path) -> int:
    """The Llama-3.1-8B shape with random bf16 weights (bench.gpu's), as a Hugging Face folder."""
    from bench.gpu import LLAMA_31_8B

    return write_random_model(directory, LLAMA_31_8B, "bfloat16", "cuda")


def write_random_model(directory: Path, config: Any, dtype: str, device: str) -> int:
    """`config` (a ModelConfig) with bench.gpu's random weights drawn on `device`, written as a
    Hugging Face folder (config.json, model.safetensors, the word-level tokenizer); returns its
    vocabulary size."""
    import torch
    from safetensors.torch import save_file

    from baton_engine.model.loader.hf_export import hf_config
    from bench.gpu import random_weights

    weights = random_weights(config, getattr(torch, dtype), device, seed=1)
    save_file({name: t.cpu() for name, t in weights.items()}, str(directory / "model.safetensors"))
    del weights
    if device == "cuda":
        torch.cuda.empty_cache()
    (directory / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2) + "\n")
    write_word_tokenizer(directory, config.vocab_size)
    return int(config.vocab_size)


def gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def shared_gpu_kv_blocks() -> int:
    """--share-gpu: KV blocks each engine gets from its share of GPU 0 (the 8B shape's blocks)."""
    import torch

    from bench.gpu import LLAMA_31_8B

    cfg = LLAMA_31_8B
    total = torch.cuda.get_device_properties(0).total_memory
    weight_bytes = 2 * (
        2 * cfg.vocab_size * cfg.hidden_size
        + cfg.num_layers
        * (
            cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
    )
    per_block = BLOCK_SIZE * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return int((SHARED_GPU_FRACTION * total - weight_bytes - GPU_SPARE_BYTES) // per_block)


# -- the deployment: the operator's flags, on loopback ---------------------------------------------


@dataclass
class EngineLaunch:
    name: str
    role: str
    """The operator's role: prefill, decode or engine (aggregated)."""
    argv: list[str]
    port: int
    kv_events_port: int
    kv_replay_port: int
    gpu: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router_url(self) -> str:
        """The URL the router is given, with this engine's KV-event ports as a fragment."""
        return (
            f"{self.url}#{contract.PORT_KV_EVENTS}={self.kv_events_port},"
            f"{contract.PORT_KV_EVENTS_REPLAY}={self.kv_replay_port}"
        )


def deployment_spec(layout: str, settings: Settings, max_model_len: int) -> Any:
    from baton_operator.models import InferenceDeploymentSpec

    engine: dict[str, Any] = {
        "device": settings.device,
        "blockSize": BLOCK_SIZE,
        "maxModelLen": max_model_len,
        "maxNumBatchedTokens": settings.max_num_batched_tokens,
    }
    if settings.num_kv_blocks is not None:
        engine["numKvBlocks"] = settings.num_kv_blocks
    doc: dict[str, Any] = {
        # The source only names the model in the KV-compatibility key; the engines load `model`.
        "model": {"name": SERVED_NAME, "source": "builtin:smollm2-135m-instruct"},
        "mode": layout,
        "engine": engine,
    }
    return InferenceDeploymentSpec.model_validate(doc)


def _set_flag(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def engine_launches(layout: str, settings: Settings, model: Path, max_model_len: int) -> list[EngineLaunch]:
    from baton_operator.builders import BuildContext, Owner
    from baton_operator.builders.engine import engine_args, role_engine

    ctx = BuildContext(
        Owner(f"bench-{layout}", "bench", "bench-uid"), deployment_spec(layout, settings, max_model_len)
    )
    roles = (
        [contract.ROLE_PREFILL, contract.ROLE_DECODE]
        if layout == "disaggregated"
        else [contract.ROLE_AGGREGATED] * 2
    )
    launches = []
    for i, role in enumerate(roles):
        args = engine_args(ctx, role, role_engine(ctx, role), str(model))
        port, events, replay = free_port(), free_port(), free_port()
        _set_flag(args, contract.FLAG_HOST, "127.0.0.1")
        _set_flag(args, contract.FLAG_PORT, str(port))
        _set_flag(args, contract.FLAG_KV_TRANSFER_PORT, str(free_port()))
        _set_flag(args, contract.FLAG_KV_EVENTS_PORT, str(events))
        _set_flag(args, contract.FLAG_KV_EVENTS_REPLAY_PORT, str(replay))
        gpu = None if settings.device == "cpu" else ("0" if settings.share_gpu else str(i))
        launches.append(EngineLaunch(f"{role}{i}", role, args, port, events, replay, gpu))
    return launches


def router_argv(
    layout: str, settings: Settings, model: Path, engines: Sequence[EngineLaunch], port: int
) -> list[str]:
    """The operator's router flags with static discovery of `engines` in place of the pod watch."""
    from baton_operator.builders import BuildContext, Owner
    from baton_operator.builders.router import router_args

    ctx = BuildContext(
        Owner(f"bench-{layout}", "bench", "bench-uid"), deployment_spec(layout, settings, 1024)
    )
    rendered = router_args(ctx, str(model))
    args: list[str] = []
    skip = {
        contract.FLAG_ROUTER_DISCOVERY, contract.FLAG_ROUTER_NAMESPACE, contract.FLAG_ROUTER_PREFILL_SELECTOR,
        contract.FLAG_ROUTER_DECODE_SELECTOR, contract.FLAG_ROUTER_ENGINE_SELECTOR,
    }  # fmt: skip
    i = 0
    while i < len(rendered):
        if rendered[i] in skip:
            i += 2
            continue
        args.append(rendered[i])
        i += 1
    _set_flag(args, contract.FLAG_ROUTER_HOST, "127.0.0.1")
    _set_flag(args, contract.FLAG_ROUTER_PORT, str(port))
    by_role: dict[str, list[str]] = {}
    for engine in engines:
        by_role.setdefault(engine.role, []).append(engine.router_url)
    args += [contract.FLAG_ROUTER_DISCOVERY, contract.DISCOVERY_STATIC]
    for role, urls in by_role.items():
        args += ["--engine" if role == contract.ROLE_AGGREGATED else f"--{role}", *urls]
    # What the router reads from pod annotations under Kubernetes discovery.
    args += [contract.FLAG_ROUTER_BLOCK_SIZE, str(BLOCK_SIZE), contract.FLAG_ROUTER_PREFIX_HASH, "fast"]
    return args


# -- processes ---------------------------------------------------------------------------------------


@dataclass
class Started:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Fleet:
    """Every process the bench started, each the leader of its own session (a server and its
    engine-core child are stopped together by group id)."""

    work: Path
    started: list[Started] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], env: dict[str, str], url: str) -> Started:
        log = self.work / f"{name}-{len(self.started)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started = Started(name, process, log, url)
        self.started.append(started)
        progress(f"started {name} (pid {process.pid}, {url})")
        return started

    def wait_ready(self, started: Started, timeout_s: float) -> None:
        def ready() -> bool:
            if started.process.poll() is not None:
                raise RuntimeError(
                    f"{started.name} exited with {started.process.returncode} before it was ready:\n"
                    f"{started.log_tail()}"
                )
            try:
                return httpx.get(started.url + contract.PATH_READY, timeout=5.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=timeout_s, interval=0.5, message=f"{started.name} to be ready")

    def stop_all(self) -> None:
        """Stop every group (SIGTERM, then SIGKILL) and wait until none of its processes is left:
        an engine core killed with its server may take a moment to go."""
        for started in reversed(self.started):
            stop_group(started.process, timeout=30.0)
            wait_for(
                lambda pgid=started.process.pid: not group_members(pgid),
                timeout=30.0,
                message=f"{started.name}'s processes to exit",
            )
        self.started.clear()

    @property
    def pids(self) -> list[int]:
        return [s.process.pid for s in self.started]


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    return [pid for pid, (_, group) in process_table().items() if group == pgid]


def engine_env(launch: EngineLaunch, settings: Settings, key: str) -> dict[str, str]:
    env = dict(os.environ)
    env[contract.ENV_KV_TRANSFER_KEY] = key
    env.pop(contract.ENV_POD_IP, None)
    if launch.gpu is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = str(settings.threads)
    else:
        env["CUDA_VISIBLE_DEVICES"] = launch.gpu
    return env


@contextlib.contextmanager
def deployment(
    layout: str, settings: Settings, model: Path, engines: Sequence[EngineLaunch], fleet: Fleet
) -> Iterator[str]:
    """`engines` and the router started and ready (yields the router's URL); on exit, or when any
    of them fails to start, every process of the fleet is stopped."""
    key = secrets.token_hex(16)
    try:
        started = [
            fleet.spawn(
                e.name,
                [sys.executable, "-m", "baton_engine.cli", "serve", *e.argv],
                engine_env(e, settings, key),
                e.url,
            )
            for e in engines
        ]
        for s in started:
            fleet.wait_ready(s, START_TIMEOUT_S)
        port = free_port()
        router_env = dict(os.environ)
        router_env.pop(contract.ENV_POD_IP, None)
        router = fleet.spawn(
            "router",
            [
                sys.executable,
                "-m",
                "baton_engine.router.cli",
                *router_argv(layout, settings, model, engines, port),
            ],
            router_env,
            f"http://127.0.0.1:{port}",
        )
        fleet.wait_ready(router, 180.0)
        yield router.url
    finally:
        fleet.stop_all()


# -- load --------------------------------------------------------------------------------------------


@dataclass
class Record:
    prompt_tokens: int
    sent_at: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0
    streamed: int = 0
    """Tokens streamed (words of the chunks' text)."""
    tokens: int = 0
    """Tokens generated, from the final usage chunk."""
    done_at: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Load:
    rate: float
    arrivals_s: list[float]
    prompts: list[list[int]]


def make_load(rate: float, index: int, settings: Settings, vocab: int) -> Load:
    """The seeded requests of one rate, the same for every layout: a Poisson process over
    `duration_s` (the first request at 0; the count is random, rate x duration on average)."""
    rng = np.random.default_rng([settings.seed, index])
    gaps = rng.exponential(1.0 / rate, int(rate * settings.duration_s * 2) + 16)
    arrivals = np.concatenate(([0.0], np.cumsum(gaps)))
    arrivals = arrivals[arrivals < settings.duration_s]
    count = len(arrivals)
    low, high = settings.prompt_tokens
    lengths = rng.integers(low, high + 1, count)
    prompts = [rng.integers(FIRST_TOKEN, vocab, int(n)).tolist() for n in lengths]
    return Load(rate, [float(a) for a in arrivals], prompts)


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], settings: Settings, record: Record
) -> None:
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": settings.output_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.tokens = int(chunk["usage"]["completion_tokens"])
                # One word per token (the word-level tokenizer): a chunk's words are its tokens.
                words = sum(len(c.get("text", "").split()) for c in chunk.get("choices", ()))
                if words == 0:
                    continue
                record.chunks += 1
                record.streamed += words
                if last is None:
                    record.ttft_s = now - record.sent_at
                else:
                    record.gaps_s.append(now - last)
                # The chunk's other tokens came with it: no gap after its first.
                record.gaps_s += [0.0] * (words - 1)
                last = now
        record.done_at = time.perf_counter()
        if record.tokens != settings.output_tokens or record.streamed != record.tokens:
            record.error = (
                f"{record.tokens} tokens (usage), {record.streamed} streamed, not {settings.output_tokens}"
            )
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def drive(url: str, load: Load, settings: Settings) -> tuple[list[Record], float]:
    """Send `load` open-loop (each request at its arrival time, whatever is still running);
    returns the records and the wall time from the first arrival to the last answer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(settings.drain_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        records: list[Record] = []
        tasks = []
        for at, prompt in zip(load.arrivals_s, load.prompts, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = Record(len(prompt), time.perf_counter())
            records.append(record)
            tasks.append(asyncio.create_task(one_request(client, url, prompt, settings, record)))
        last_arrival = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=settings.drain_timeout_s + 60.0)
        ends = [r.done_at for r in records if r.done_at is not None]
        wall = (max(ends) if ends else last_arrival) - start
    return records, wall


def warm_up(url: str, settings: Settings, vocab: int) -> None:
    """A few requests of the longest and shortest prompt through the router (kernel compiles,
    first allocations, connection pools), concurrently so both engines of a pool get some."""
    rng = np.random.default_rng([settings.seed, 999])
    low, high = settings.prompt_tokens
    prompts = [
        rng.integers(FIRST_TOKEN, vocab, high if i % 2 else low).tolist()
        for i in range(settings.warmup_requests)
    ]
    load = Load(0.0, [0.0] * len(prompts), prompts)
    records, _ = asyncio.run(drive(url, load, settings))
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed}")


# -- figures -----------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    return round(float(np.percentile(values, q)) * scale, 4) if values else None


def summarize(records: list[Record], wall_s: float, settings: Settings) -> dict[str, Any]:
    """The figures of one rate. Rates per second are over the window: the load's duration, or
    longer when the last answer came after it (`wall_s`: first arrival to last answer)."""
    window = max(wall_s, settings.duration_s)
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    chunks = sum(r.chunks for r in ok)

    def meets(r: Record) -> bool:
        tpot = sum(r.gaps_s) / len(r.gaps_s) if r.gaps_s else 0.0
        return r.ttft_s is not None and r.ttft_s <= settings.slo_ttft_s and tpot * 1e3 <= settings.slo_itl_ms

    good = sum(1 for r in ok if meets(r))
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records),
        "arrived_rps": round(len(records) / settings.duration_s, 3),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "itl_p50_ms": _percentile(gaps, 50, 1e3),
        "itl_p99_ms": _percentile(gaps, 99, 1e3),
        "output_tokens_per_s": round(tokens / window, 2),
        "offered_output_tokens_per_s": round(len(records) * settings.output_tokens / settings.duration_s, 2),
        "goodput_fraction": round(good / len(records), 4) if records else None,
        "goodput_rps": round(good / window, 4),
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in records) / len(records), 1),
        "wall_s": round(wall_s, 2),
        "window_s": round(window, 2),
    }


#: (figure, True when higher is better)
VERDICT_FIGURES = (
    ("ttft_p50_s", False),
    ("ttft_p99_s", False),
    ("itl_p50_ms", False),
    ("itl_p99_ms", False),
    ("output_tokens_per_s", True),
    ("goodput_fraction", True),
)


def verdict(pd: dict[str, Any], agg: dict[str, Any]) -> dict[str, Any]:
    """Which layout wins each figure (within `TIE`: a tie), P/D / aggregated ratios, one line."""
    winners: dict[str, str | None] = {}
    ratios: dict[str, float | None] = {}
    for name, higher_better in VERDICT_FIGURES:
        a, b = pd.get(name), agg.get(name)
        if a is None or b is None:
            winners[name], ratios[name] = None, None
            continue
        ratios[name] = round(a / b, 3) if b else None
        if abs(a - b) <= TIE * max(abs(a), abs(b)):
            winners[name] = "tie"
        else:
            winners[name] = "disaggregated" if (a > b) == higher_better else "aggregated"
    pd_wins = [n for n, w in winners.items() if w == "disaggregated"]
    agg_wins = [n for n, w in winners.items() if w == "aggregated"]

    def listed(names: list[str]) -> str:
        return ", ".join(f"{n} ({ratios[n]}x)" for n in names) or "nothing"

    line = f"P/D wins {listed(pd_wins)}; aggregated wins {listed(agg_wins)} (ratios P/D / aggregated)"
    return {"winners": winners, "ratio_pd_over_aggregated": ratios, "summary": line}


def _metric_sum(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}{contract.PATH_METRICS}", timeout=10.0).text
    return float(
        sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
    )


def transfer_counters(router_url: str, engines: Sequence[EngineLaunch]) -> dict[str, float]:
    """The counters that say whether P/D really moved KV: bytes the decode engine pulled, its
    failed pulls (each one recomputed the prompt), leases that expired on the prefill engine
    before their pull, and the router's fallbacks."""
    roles = {e.role: e.url for e in engines}
    counters = {"router_fallbacks": _metric_sum(router_url, contract.M_ROUTER_FALLBACKS)}
    if contract.ROLE_DECODE in roles:
        decode, prefill = roles[contract.ROLE_DECODE], roles[contract.ROLE_PREFILL]
        counters["kv_transfer_bytes"] = _metric_sum(decode, contract.M_KV_TRANSFER_BYTES)
        counters["kv_transfer_failures"] = _metric_sum(decode, contract.M_KV_TRANSFER_FAILURES)
        counters["kv_leases_expired"] = _metric_sum(prefill, contract.M_KV_LEASES_EXPIRED)
    return counters


def run_layout(
    layout: str, settings: Settings, model: Path, vocab: int, loads: list[Load], fleet: Fleet
) -> dict[str, dict[str, Any]]:
    max_model_len = -(-(settings.prompt_tokens[1] + settings.output_tokens) // BLOCK_SIZE) * BLOCK_SIZE
    progress(f"{layout}: starting two engines and the router")
    by_rate: dict[str, dict[str, Any]] = {}
    engines = engine_launches(layout, settings, model, max_model_len)
    with deployment(layout, settings, model, engines, fleet) as url:
        warm_up(url, settings, vocab)
        for load in loads:
            before = transfer_counters(url, engines)
            progress(f"{layout}: rate {load.rate}/s, {len(load.prompts)} requests")
            records, wall = asyncio.run(drive(url, load, settings))
            after = transfer_counters(url, engines)
            figures = summarize(records, wall, settings)
            figures.update({k: round(after[k] - before[k], 1) for k in after})
            by_rate[f"{load.rate:g}"] = figures
            progress(
                f"{layout}: rate {load.rate}/s: {figures['completed']}/{figures['requests']} done, "
                f"TTFT p50 {figures['ttft_p50_s']} s, ITL p50 {figures['itl_p50_ms']} ms, "
                f"goodput {figures['goodput_fraction']}"
            )
    return by_rate


def run(settings: Settings, work: Path, fleet: Fleet) -> tuple[dict[str, Any], dict[str, str]]:
    """The figures by rate, and the layouts that failed (layout -> error): a layout that fails
    (an engine that does not start, a failed warm-up) is reported and the next one still runs,
    so one GPU call gives whatever it can."""
    model = work / "model"
    model.mkdir()
    progress(f"writing the {'8B-shape' if settings.device == 'cuda' else 'tiny'} random model to {model}")
    vocab = build_gpu_model(model) if settings.device == "cuda" else build_cpu_model(model)
    loads = [make_load(rate, i, settings, vocab) for i, rate in enumerate(settings.rates)]
    layouts: dict[str, dict[str, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    for layout in settings.layouts:
        try:
            layouts[layout] = run_layout(layout, settings, model, vocab, loads, fleet)
        except Exception as exc:  # reported in the JSON; the exit status says it failed
            failed[layout] = f"{type(exc).__name__}: {exc}"[-4000:]
            progress(f"{layout} failed: {failed[layout]}")
    rates: dict[str, Any] = {}
    for load in loads:
        key = f"{load.rate:g}"
        entry: dict[str, Any] = {layout: figures[key] for layout, figures in layouts.items()}
        if set(LAYOUTS) <= set(layouts):
            entry["verdict"] = verdict(entry["disaggregated"], entry["aggregated"])
        rates[key] = entry
    return rates, failed


def _cell(value: Any) -> str:
    return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def markdown_table(result: dict[str, Any]) -> str:
    """One row per rate and layout (then the rate's verdict), as bench/RESULTS.md records it."""
    rows = [
        "| rate (req/s) | layout | completed / sent (errors) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| output tok/s (offered) | goodput fraction (req/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate in sorted(result["rates"], key=float):
        entry = result["rates"][rate]
        for layout in LAYOUTS:
            if layout not in entry:
                continue
            f = entry[layout]
            rows.append(
                f"| {rate} | {layout} | {f['completed']} / {f['requests']} ({f['errors']}) "
                f"| {_cell(f['ttft_p50_s'])} / {_cell(f['ttft_p99_s'])} "
                f"| {_cell(f['itl_p50_ms'])} / {_cell(f['itl_p99_ms'])} "
                f"| {_cell(f['output_tokens_per_s'])} ({_cell(f['offered_output_tokens_per_s'])}) "
                f"| {_cell(f['goodput_fraction'])} ({_cell(f['goodput_rps'])}) |"
            )
        if "verdict" in entry:
            rows.append(f"| {rate} | verdict | {entry['verdict']['summary']} | | | | |")
    return "\n".join(rows)


def figure_note(settings: Settings) -> str:
    if settings.device == "cpu":
        return "CPU-only shape check (tiny random model, engines sharing the CPU cores): not a P/D result"
    if settings.share_gpu:
        return "not the figure: both engines share GPU 0 (--share-gpu), a check of the GPU path only"
    return "the figure: each engine on its own GPU"


def _version(name: str) -> str | None:
    from importlib import metadata

    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(name)
    return None


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    if args.device == "cuda":
        base = GPU_QUICK if args.quick else GPU
    else:
        base = CPU_QUICK if args.quick else CPU
    changes: dict[str, Any] = {"share_gpu": args.share_gpu}
    if args.rates is not None:
        try:
            changes["rates"] = tuple(float(r) for r in args.rates.split(","))
        except ValueError:
            parser.error(f"--rates: {args.rates!r} is not a comma-separated list of numbers")
        if any(r <= 0 for r in changes["rates"]):
            parser.error(f"--rates: every rate must be > 0 (requests per second), got {args.rates!r}")
    if args.prompt_tokens is not None:
        try:
            low, high = (int(v) for v in args.prompt_tokens.split(","))
        except ValueError:
            parser.error(f"--prompt-tokens: {args.prompt_tokens!r} is not MIN,MAX")
        if not 1 <= low <= high:
            parser.error(f"--prompt-tokens: need 1 <= MIN <= MAX, got {args.prompt_tokens!r}")
        changes["prompt_tokens"] = (low, high)
    if args.layouts is not None:
        layouts = tuple(args.layouts.split(","))
        unknown = [x for x in layouts if x not in LAYOUTS]
        if unknown or not layouts:
            parser.error(f"--layouts: {unknown} not in {', '.join(LAYOUTS)}")
        changes["layouts"] = layouts
    for name in ("duration", "output_tokens", "slo_ttft_s", "slo_itl_ms", "threads", "num_kv_blocks", "seed"):
        value = getattr(args, name)
        if value is not None:
            changes["duration_s" if name == "duration" else name] = value
    for name in ("duration_s", "output_tokens", "slo_ttft_s", "slo_itl_ms"):
        if name in changes and changes[name] <= 0:
            parser.error(f"--{name.removesuffix('_s').replace('_', '-')}: must be > 0")
    return dataclasses.replace(base, **changes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd",
        description="P/D (one prefill + one decode engine) against two aggregated engines behind the router.",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--share-gpu", action="store_true", help="cuda: both engines on GPU 0, memory split (not the figure)"
    )
    p.add_argument("--rates", help="offered requests per second, comma-separated (Poisson arrivals)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    p.add_argument("--prompt-tokens", help="MIN,MAX prompt tokens (uniform)")
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (EOS ignored)")
    p.add_argument("--slo-ttft-s", type=float, help="SLO: time to first token, seconds (GPU default 2)")
    p.add_argument("--slo-itl-ms", type=float, help="SLO: mean gap between tokens, ms (GPU default 50)")
    p.add_argument("--layouts", help=f"comma-separated subset of {','.join(LAYOUTS)} (default both)")
    p.add_argument("--threads", type=int, help="cpu: OpenMP threads per engine (default 1)")
    p.add_argument(
        "--num-kv-blocks", type=int, help="KV blocks per engine (default: cpu 512, cuda the engine's)"
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--work-dir", help="keep the model, the logs here (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    p.add_argument(
        "--table",
        metavar="FILE",
        help="run nothing: print the markdown table (for bench/RESULTS.md) of the result whose JSON is "
        "FILE's last line",
    )
    return p


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.table is not None:
        try:
            recorded = json.loads(Path(args.table).read_text().strip().splitlines()[-1])
        except (OSError, IndexError, json.JSONDecodeError) as exc:
            parser.error(f"--table: {args.table!r} does not end with a JSON line: {exc}")
        print(markdown_table(recorded))
        return 0
    settings = settings_from_args(args, parser)
    if settings.device == "cuda":
        gpus = gpu_count()
        if gpus < 2 and not settings.share_gpu:
            parser.error(
                f"--device cuda needs 2 GPUs (one per engine), this machine has {gpus}; "
                "--share-gpu runs both engines on GPU 0 (a check of the path, not the figure)"
            )
        if gpus < 1:
            parser.error("--device cuda --share-gpu: no GPU visible")
        if settings.share_gpu and settings.num_kv_blocks is None:
            settings = dataclasses.replace(settings, num_kv_blocks=shared_gpu_kv_blocks())
    elif settings.share_gpu:
        parser.error("--share-gpu: only with --device cuda")
    # SIGTERM ends the run like Ctrl-C: the fleet is stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pd-")))
        fleet = Fleet(work)
        stack.callback(fleet.stop_all)
        started = time.time()
        rates, failed = run(settings, work, fleet)
    result: dict[str, Any] = {
        "bench": "pd",
        "quick": settings.quick,
        "device": settings.device,
        "figure": figure_note(settings),
        "rates": rates,
        "failed_layouts": failed,
        "slo": {
            "ttft_s": settings.slo_ttft_s,
            "itl_ms": settings.slo_itl_ms,
            "itl_is": "mean gap per request (TPOT)",
        },
        "config": {
            **{k: v for k, v in dataclasses.asdict(settings).items() if k not in ("quick",)},
            "model": "llama-3.1-8b-shape, random bf16"
            if settings.device == "cuda"
            else "tiny random llama, float32",
            "router": "baton-router, static discovery, operator's router flags",
            "engines": "baton-engine serve, operator's pod flags per role",
        },
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "versions": {name: _version(name) for name in ("torch", "triton", "httpx")},
        "elapsed_s": round(time.time() - started, 1),
    }
    if settings.device == "cuda":
        import torch

        result["machine"]["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
