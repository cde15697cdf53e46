"""`baton-engine serve` as a real subprocess on 127.0.0.1 with a free port, stopped by pid."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from baton_support.ports import free_port
from baton_support.wait import wait_for

BATON_ENGINE = str(Path(sys.executable).with_name("baton-engine"))


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_LIVE_GROUPS: set[int] = set()
"""Process groups of the processes started here and not yet stopped."""


@atexit.register
def _kill_leftover_groups() -> None:
    """A test run that ends early (an error in a fixture, Ctrl-C) leaves no server or engine core
    behind: each one runs in its own process group, killed here as a whole."""
    for group in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


class LoopbackProcess:
    """A command serving HTTP on 127.0.0.1:`port`, its output in `log_path`, stopped by pid.

    It runs in its own process group (with its children: an engine core), so that a run killed
    before it could stop them leaves processes findable by that group, and killable as one."""

    label = "process"

    def __init__(
        self,
        argv: list[str],
        port: int,
        log_path: Path,
        http_timeout: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, process_group=0
        )
        _LIVE_GROUPS.add(self.proc.pid)
        self.http = httpx.Client(base_url=self.url, timeout=http_timeout)

    def wait_ready(self, timeout: float, interval: float, stop_signal: int) -> None:
        """Wait for /ready to answer 200; on failure stop the process with `stop_signal` first."""
        try:
            wait_for(
                lambda: self.answers("/ready") == 200,
                timeout=timeout,
                message=f"{self.url}/ready",
                interval=interval,
            )
        except BaseException:
            self.stop(stop_signal)
            raise

    def answers(self, path: str) -> int | None:
        """The status of GET `path`, or None while nothing listens yet."""
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.label} exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}"
            )
        try:
            return self.http.get(path).status_code
        except httpx.TransportError:
            return None

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the process by pid and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the process and what it started
                self.proc.wait()
        _LIVE_GROUPS.discard(self.proc.pid)
        self.http.close()
        self._log.close()
        return self.proc.returncode


class ServerProcess(LoopbackProcess):
    label = "server"

    def __init__(
        self, model: str, *args: str, log_path: Path, ready_timeout: float = 300.0, wait_ready: bool = True
    ) -> None:
        port = free_port()
        argv = [BATON_ENGINE, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *args]
        super().__init__(argv, port, log_path, http_timeout=60.0)
        self.ready_timeout = ready_timeout
        if wait_ready:
            self.wait_ready()

    def wait_ready(
        self, timeout: float | None = None, interval: float = 0.2, stop_signal: int = signal.SIGKILL
    ) -> None:
        super().wait_ready(self.ready_timeout if timeout is None else timeout, interval, stop_signal)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def core_pid(self) -> int | None:
        """The engine core child's pid while the server runs (None once it exited)."""
        if self.proc.poll() is not None:
            return None
        children = child_pids(self.proc.pid)
        return children[0] if children else None

    def stats(self) -> dict[str, Any]:
        response = self.http.get("/debug/stats")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def aborted_requests(self, model: str) -> float:
        """baton_request_success_total{finished_reason="abort"} of `model` (0 before any abort)."""
        wanted = f'baton_request_success_total{{finished_reason="abort",model_name="{model}"}} '
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(wanted):
                return float(line.split()[-1])
        return 0.0

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request is queued or running and no KV block is in use."""

        def idle() -> dict[str, Any] | None:
            stats = self.stats()
            quiet = (
                stats["num_used_kv_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
            )
            return stats if quiet else None

        result: dict[str, Any] = wait_for(
            idle, timeout=timeout, message="the engine to go idle with every KV block free"
        )
        return result
