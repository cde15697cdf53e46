"""A real vLLM (the CPU build of the release on PyPI, from serving24's cached venv,
`scripts/vllm-venv.sh`) serving SmolLM2 exported as a HF folder, with ZMQ KV events on; and the
recorder that turns its output into the committed fixtures under tests/interop/data/:

    python -m tests.interop.vllm_peer record [sha256|sha256_cbor ...]   # minutes per algorithm

A fixture holds the raw frames exactly as they came off the sockets (the published batches and a
replay answer), the token ids that produced them, the hash algorithm and seed in force, and the
vLLM version, plus /metrics texts scraped at rest and under load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

from baton_support.ports import free_port

DATA = Path(__file__).resolve().parent / "data"
CACHE = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))
VENV = Path(os.environ.get("BATON_VLLM_VENV", CACHE / "vllm-venv"))
MODEL_DIR = CACHE / "models" / "smollm2-135m-instruct-f32"
SERVED_NAME = "smollm2"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
#: Few KV blocks, so that a handful of prompts evicts cached ones (BlockRemoved events).
NUM_BLOCKS = 24
MAX_NUM_SEQS = 16


@dataclass
class VllmServer:
    url: str
    pub_endpoint: str  # where the recorder's SUB binds; vLLM's PUB connects to it
    replay_endpoint: str  # vLLM's ROUTER binds it
    topic: str
    proc: subprocess.Popen[bytes]
    log: Path


def available() -> str | None:
    """Why a vLLM peer cannot run here (None when it can)."""
    if not (VENV / "bin" / "python").exists():
        return f"no vLLM venv at {VENV} (bash scripts/vllm-venv.sh builds it)"
    if not (MODEL_DIR / "model.safetensors").exists():
        return f"no exported model at {MODEL_DIR} (baton-engine export --model builtin:smollm2-135m-instruct)"
    return None


def version() -> str:
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _failure(log: Path) -> str:
    """The log's error lines (the root cause sits far above the traceback's end) and its tail."""
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if "Error" in line or "error" in line][:20]
    return "\n".join(errors)[-3000:] + "\n...\n" + text[-2000:]


@contextmanager
def vllm_server(workdir: Path, hash_algo: str, sub: zmq.Socket | None = None) -> Iterator[VllmServer]:
    """Start `vllm serve` (stopped by pid on exit). With `sub`, that socket is bound first and
    vLLM's PUB connects to it (vLLM binds only wildcard and ipc endpoints); without, vLLM's PUB
    binds an ipc endpoint under `workdir` for subscribers to connect to, as on a pod."""
    port, replay_port = free_port(), free_port()
    if sub is not None:
        pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
        sub.bind(pub_endpoint)
    else:
        pub_endpoint = f"ipc://{workdir / f'kv-events-{port}'}"
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    topic = f"kv@127.0.0.1@{SERVED_NAME}"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub_endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": topic,
    }
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache (AllBlocksCleared)
    }
    env.pop("PYTHONHASHSEED", None)  # vLLM's default root: its fixed seed
    argv = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL_DIR),
        "--served-model-name", SERVED_NAME, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "512", "--max-num-batched-tokens", "512",
        "--enable-prefix-caching", "--prefix-caching-hash-algo", hash_algo, "--enforce-eager",
        "--kv-events-config", json.dumps(events),
    ]  # fmt: skip
    log = workdir / f"vllm-{hash_algo}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}", pub_endpoint, replay_endpoint, topic, proc, log)
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {_failure(log)}")
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not healthy after 900 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def drain(sub: zmq.Socket, quiet_s: float) -> list[list[bytes]]:
    """Every message that arrives until none has for `quiet_s`."""
    got = []
    while sub.poll(int(quiet_s * 1000)):
        got.append(sub.recv_multipart())
    return got


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for every batch from `start` (a DEALER, as indexers do); the frames
    of each answer, end marker included."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answers = []
        while True:
            if not dealer.poll(30_000):
                raise TimeoutError("no end-of-replay marker within 30 s")
            frames = dealer.recv_multipart()
            answers.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                return answers
    finally:
        dealer.close()


#: Prompts (token ids) of the recorded run, in order; see record().
PROMPT_A = list(range(1000, 1072))  # two full blocks and a partial one
PROMPT_B = PROMPT_A[:32] + list(range(2000, 2040))  # shares block 0 with A
FILLERS = [list(range(3000 + 300 * i, 3000 + 300 * i + 160)) for i in range(7)]  # 5 blocks each


def record_events(workdir: Path, hash_algo: str, with_metrics: bool) -> dict[str, Any]:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    metrics: dict[str, str] = {}
    try:
        with vllm_server(workdir, hash_algo, sub) as server:
            steps: list[dict[str, Any]] = []
            published: list[list[bytes]] = []

            def step(name: str, prompt: list[int] | None) -> None:
                if prompt is not None:
                    complete(server, prompt)
                else:
                    httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
                    # vLLM publishes events at its next step: a one-block-short prompt makes one.
                    complete(server, [7, 8, 9, 10], max_tokens=1)
                got = drain(sub, 3.0)
                steps.append({"name": name, "prompt": prompt, "messages": len(got)})
                published.extend(got)

            step("a", PROMPT_A)
            step("a-again", PROMPT_A)
            step("b", PROMPT_B)
            for i, filler in enumerate(FILLERS):
                step(f"filler-{i}", filler)
            step("reset", None)
            if with_metrics:
                metrics["idle"] = httpx.get(f"{server.url}/metrics", timeout=30).text
                metrics["loaded"] = scrape_under_load(server)
            answer = replay(server.replay_endpoint, 0)
            return {
                "vllm_version": version(),
                "hash_algo": hash_algo,
                "hash_seed": None,  # PYTHONHASHSEED unset: vLLM's fixed root seed
                "block_size": BLOCK_SIZE,
                "topic": server.topic,
                "steps": steps,
                "published": published,
                "replay_from_0": answer,
                "metrics": metrics,
            }
    finally:
        sub.close()


def scrape_under_load(server: VllmServer) -> str:
    """/metrics while MAX_NUM_SEQS requests run and 4 more wait (long generations, ignore_eos)."""
    import concurrent.futures

    def running(text: str) -> tuple[float, float]:
        values = {}
        for line in text.splitlines():
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                if line.startswith(name + "{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        return values.get("vllm:num_requests_running", 0.0), values.get("vllm:num_requests_waiting", 0.0)

    prompts = [list(range(5000 + 17 * i, 5000 + 17 * i + 8)) for i in range(MAX_NUM_SEQS + 4)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, server, p, 20, ignore_eos=True) for p in prompts]
        deadline = time.monotonic() + 300
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
            if running(text) == (float(MAX_NUM_SEQS), 4.0):
                break
            time.sleep(0.05)
        else:
            raise TimeoutError(f"never saw {MAX_NUM_SEQS} running and 4 waiting: {running(text)}")
        for future in futures:
            future.result()
    return text


def write_fixture(recorded: dict[str, Any]) -> Path:
    DATA.mkdir(parents=True, exist_ok=True)
    name = f"vllm-{recorded['vllm_version']}-kv-events-{recorded['hash_algo']}.msgpack"
    metrics = recorded.pop("metrics")
    path = DATA / name
    path.write_bytes(msgpack.packb(recorded, use_bin_type=True))
    for state, text in metrics.items():
        (DATA / f"vllm-{recorded['vllm_version']}-metrics-{state}.txt").write_text(text)
    return path


def load_fixture(hash_algo: str) -> dict[str, Any]:
    (path,) = DATA.glob(f"vllm-*-kv-events-{hash_algo}.msgpack")
    doc: dict[str, Any] = msgpack.unpackb(path.read_bytes(), raw=False)
    return doc


def main(argv: list[str]) -> int:
    if argv[:1] != ["record"]:
        print(__doc__, file=sys.stderr)
        return 2
    reason = available()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="baton-vllm-"))  # kept: vLLM's logs
    print(f"vLLM logs in {workdir}", file=sys.stderr)
    algos = argv[1:] or ["sha256", "sha256_cbor"]
    for algo in algos:
        path = write_fixture(record_events(workdir, algo, with_metrics=algo == "sha256"))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
