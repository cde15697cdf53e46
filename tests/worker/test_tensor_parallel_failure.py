"""A tensor-parallel rank killed (or stopped: no heartbeat) while a request decodes (CPU, gloo,
real rank processes, a tiny random Llama): the request gets an error naming the rank, never a
hang; `baton-engine serve` turns unhealthy and exits 1 within a bound; the offline `LLM` raises
`RankFailure`. Rank 0 (the engine core) dying takes its ranks with it. No process is left in
any case."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from baton_support.tiny_models import parity_model
from baton_support.wait import wait_for
from tests.server.server_process import ServerProcess, child_pids, pid_alive
from tests.worker.tp_helpers import live_children

pytestmark = pytest.mark.slow

MODEL = parity_model("llama", seed=5).replace(dtype="float32", chat_tokenizer=True)
REPO = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 60.0
"""How long the server may take from the kill to its exit (seconds on an idle machine: the
watchdog polls every 0.1 s; the bound is for a loaded CI machine)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tp-failure") / "llama"
    MODEL.save(directory)
    return directory


@pytest.fixture()
def no_process_left() -> Iterator[None]:
    before = live_children()
    yield
    assert live_children(before) == []


def _tp2_server(model_dir: Path, log: Path, hang_timeout_s: float = 300.0) -> tuple[ServerProcess, int, int]:
    """A TP=2 server, its engine core's pid and its rank 1's pid."""
    args = [
        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
        "--tensor-parallel-size", "2", "--tensor-parallel-timeout-seconds", str(hang_timeout_s),
    ]  # fmt: skip
    server = ServerProcess(str(model_dir), *args, log_path=log)
    core = int(server.stats()["core_pid"])
    ranks = child_pids(core)
    assert len(ranks) == 1, ranks
    return server, core, ranks[0]


def _stream_and_kill(server: ServerProcess, victim: int, sig: int = signal.SIGKILL) -> tuple[int, list[str]]:
    """Stream a long completion; send `victim` `sig` once the first token arrived; the rest of
    the stream's events."""

    async def main() -> tuple[int, list[str]]:
        body = {"model": str(server_model(server)), "prompt": [1, 2, 3, 4, 5], "max_tokens": 200}
        body |= {"ignore_eos": True, "stream": True, "temperature": 0}
        async with httpx.AsyncClient(base_url=server.url, timeout=EXIT_BOUND_S) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                os.kill(victim, sig)
                return response.status_code, [line async for line in lines if line.startswith("data: ")]

    return asyncio.run(main())


def server_model(server: ServerProcess) -> str:
    name: str = server.http.get("/v1/models").json()["data"][0]["id"]
    return name


class HealthWatch:
    """Polls ``/health`` on a fresh connection each time until the server process exits; the
    statuses seen, in order (None: nothing listened)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen: list[int | None] = []
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while self.server.proc.poll() is None:
            try:
                status: int | None = httpx.get(f"{self.server.url}/health", timeout=EXIT_BOUND_S).status_code
            except httpx.TransportError:
                status = None
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            time.sleep(0.02)

    def phases(self) -> list[int | None]:
        self._thread.join(timeout=30)
        return self.seen


def test_serve_exits_1_when_a_rank_is_killed_mid_request(
    model_dir: Path, tmp_path: Path, no_process_left: None
) -> None:
    server, core, rank1 = _tp2_server(model_dir, tmp_path / "server.log")
    try:
        watch = HealthWatch(server)
        status, events = _stream_and_kill(server, rank1)
        killed_at = time.monotonic()
        code = server.proc.wait(EXIT_BOUND_S)
        exit_s = time.monotonic() - killed_at
    finally:
        server.stop(signal.SIGKILL, timeout=10)
    reason = f"tensor-parallel rank 1 (pid {rank1}) exited with code -9"
    assert status == 200
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["message"]) == ("engine_dead", f"engine core stopped: {reason}")
    assert code == 1, server.log_text()[-3000:]
    assert exit_s < EXIT_BOUND_S
    # /health answered 200, then 503 (from the failure until uvicorn's next tick closes the
    # listener: a window the poll may miss), then nothing: never healthy again.
    phases = watch.phases()
    assert phases in ([200, 503, None], [200, 503], [200, None]), phases
    log = server.log_text()
    assert f"core: {reason}; stopping the engine" in log
    assert f"engine core stopped: {reason}; exiting with code 1" in log
    assert not pid_alive(core) and not pid_alive(rank1)


def test_serve_exits_1_when_a_rank_hangs_mid_request(
    model_dir: Path, tmp_path: Path, no_process_left: None
) -> None:
    """A rank that stops (SIGSTOP: alive, silent) is noticed by its missing heartbeat."""
    hang_timeout_s = 10.0  # a loaded machine must not starve a heartbeat thread this long
    server, core, rank1 = _tp2_server(model_dir, tmp_path / "server.log", hang_timeout_s)
    try:
        status, events = _stream_and_kill(server, rank1, signal.SIGSTOP)
        code = server.proc.wait(EXIT_BOUND_S + hang_timeout_s)
    finally:
        if pid_alive(rank1):
            os.kill(rank1, signal.SIGCONT)
        server.stop(signal.SIGKILL, timeout=10)
    reason = f"tensor-parallel rank 1 (pid {rank1}) is not responding (no heartbeat for "
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (status, events[-1], error["code"]) == (200, "data: [DONE]", "engine_dead")
    assert error["message"].startswith(f"engine core stopped: {reason}"), error
    waited = float(error["message"].removeprefix(f"engine core stopped: {reason}").split(" s)")[0])
    assert hang_timeout_s <= waited < hang_timeout_s + EXIT_BOUND_S  # shown to 0.1 s
    assert code == 1, server.log_text()[-3000:]
    wait_for(lambda: not pid_alive(rank1), timeout=30, message="the silent rank to be killed")
    assert not pid_alive(core)


def test_killing_the_engine_core_takes_its_ranks(
    model_dir: Path, tmp_path: Path, no_process_left: None
) -> None:
    server, core, rank1 = _tp2_server(model_dir, tmp_path / "server.log")
    try:
        status, events = _stream_and_kill(server, core)
        wait_for(lambda: not pid_alive(rank1), timeout=30, message="rank 1 to die with its core")
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        health = server.http.get("/health")
        # the server outlives its core (as at TP=1): unhealthy, so that its liveness probe ends it
        assert (health.status_code, health.json()["status"]) == (503, "engine dead")
    finally:
        code = server.stop(signal.SIGTERM, timeout=EXIT_BOUND_S)
    assert status == 200 and events[-1] == "data: [DONE]"
    assert (error["code"], error["message"]) == ("engine_dead", "engine core exited with code -9")
    assert code == 0
    assert not pid_alive(core)


def _offline_run(model_dir: Path, who: str) -> subprocess.CompletedProcess[str]:
    """`llm_rank_kill` in a process of its own (the offline `LLM` is rank 0 there)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "tests.worker.llm_rank_kill", str(model_dir), "4", who],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_offline_llm_raises_rank_failure_when_a_rank_is_killed(
    model_dir: Path, no_process_left: None
) -> None:
    run = _offline_run(model_dir, "rank1")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    victim = result["victim"]
    assert result["error"] == {
        "type": "RankFailure",
        "message": f"tensor-parallel rank 1 (pid {victim}) exited with code -9",
    }
    assert result["steps"] == 4  # killed as step 4 went out: that step reported it, none ran after
    assert result["children_after_close"] == []
    assert not pid_alive(victim)


def test_the_ranks_of_an_offline_llm_die_with_its_process(model_dir: Path, no_process_left: None) -> None:
    run = _offline_run(model_dir, "self")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    (line,) = run.stdout.strip().splitlines()  # killed mid-request: nothing printed after the ranks
    (rank1,) = json.loads(line)["ranks"]
    wait_for(lambda: not pid_alive(rank1), timeout=30, message="rank 1 to die with its rank 0")
