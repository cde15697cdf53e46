"""Tensor parallelism from rank 0: the engine core's runner when ``tensor_parallel_size > 1``.

Rank 0 lives in the engine core's process (beside the one scheduler); ranks 1..N-1 are child
processes (`rank_command`, e.g. ``python -m baton_engine.entrypoints.rank_process``), each
loading only its shard. Every step goes to all ranks as one compact message
(`step_message`), then rank 0 runs its own share; the ranks' collectives meet inside the
forward, and rank 0 alone samples from the gathered logits, so tokens are those of one rank.

Failure: a watchdog thread reads the ranks' messages and watches their processes. A rank that
exits, reports a failure or sends no heartbeat for `hang_timeout_s` ends the group: one log
line names it, every other rank process is killed, and `on_fatal` runs (the core process
exits through it: the pod must not limp on with a broken group). Without `on_fatal` (the
offline `LLM`) the error surfaces as `RankFailure` from `execute`; if rank 0 is stuck inside a
collective it cannot leave, the process exits after `STUCK_GRACE_S`. Any exception in a step
breaks the group the same way (the ranks' collectives would no longer line up).

Rank processes die with rank 0 (``PR_SET_PDEATHSIG`` in `rank_process`), so none outlives it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from baton_engine.config import EngineConfig
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.model.loader.model_loading import LoadedModel
from baton_engine.model.parallel import TensorParallel
from baton_engine.worker import step_message
from baton_engine.worker.distributed import check_devices, create_store, join_group, leave_group, rank_device
from baton_engine.worker.memory import process_memory
from baton_engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

STUCK_GRACE_S = 5.0
"""Offline: how long rank 0 may stay inside a collective after a rank failed before the
process exits (gloo raises at once when a peer's connection drops; NCCL may wait forever)."""
_POLL_S = 0.1
BLAME_WAIT_S = 1.0
"""After a failed step: how long rank 0 waits for a rank process to have exited before it
blames itself."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the group cannot run another step."""


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    control: zmq.Socket[bytes]
    hello: bool = False
    ready: dict[str, Any] | None = None
    kv_port: int | None = None
    failed_message: str | None = None
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.process.pid


class TensorParallelExecutor:
    def __init__(
        self,
        config: EngineConfig,
        rank_command: Sequence[str],
        build_runner: Callable[[TensorParallel], ModelRunner],
        *,
        on_fatal: Callable[[str], None] | None = None,
        kv_result_handler: Callable[[int, Any], None] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        """`build_runner(parallel)`: rank 0's runner (each rank process builds its own the same
        way). `kv_result_handler(rank, payload)` receives the ranks' KV-transfer results (on the
        watchdog thread)."""
        size = config.tensor_parallel_size
        if size < 2:
            raise ValueError(f"TensorParallelExecutor needs tensor_parallel_size >= 2, got {size}")
        check_devices(config.device, size)
        self.config = config
        self.size = size
        self.hang_timeout_s = config.tensor_parallel_timeout_seconds
        self.on_fatal = on_fatal
        self.kv_result_handler = kv_result_handler
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._in_step = False
        self._ranks_ready = threading.Event()
        self._ranks_hello = threading.Event()
        self._dir = Path(tempfile.mkdtemp(prefix="baton-tp-"))
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        results_address = f"ipc://{self._dir / 'results.sock'}"
        self._results.bind(results_address)
        self._store = create_store(size)
        self.ranks: list[_Rank] = []
        device = rank_device(config.device, 0)
        try:
            for rank in range(1, size):
                control = self._ctx.socket(zmq.PUSH)
                control.setsockopt(zmq.LINGER, 0)
                control_address = f"ipc://{self._dir / f'control-{rank}.sock'}"
                control.bind(control_address)
                args = [
                    *rank_command,
                    "--config-json", config.model_dump_json(),
                    "--rank", str(rank),
                    "--store-port", str(self._store.port),
                    "--control", control_address,
                    "--results", results_address,
                    "--parent-pid", str(os.getpid()),
                ]  # fmt: skip
                process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
                self.ranks.append(_Rank(rank, process, control))
            atexit.register(self.close)
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()
            self._wait(self._ranks_hello, startup_timeout_s, "to start")
            self.parallel = join_group(self._store, 0, size, device)
            self.runner = build_runner(self.parallel)
            self._wait(self._ranks_ready, startup_timeout_s, "to load their shards")
        except BaseException as exc:
            failure = self.failure
            self.close()
            if failure is not None and not isinstance(exc, RankFailure):
                raise RankFailure(failure) from exc
            raise
        self.memory = {0: process_memory(device), **{r.rank: dict(r.ready or {}) for r in self.ranks}}
        """Per rank, what it held once loaded (`memory.process_memory`)."""
        log.info(
            "tensor parallelism: %d ranks ready (pids %s)",
            size, [os.getpid(), *(r.process.pid for r in self.ranks)],
        )  # fmt: skip

    # -- what the engine core and factory use ---------------------------------------------
    @property
    def loaded(self) -> LoadedModel:
        return self.runner.loaded

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_ports(self) -> list[int]:
        """The KV-transfer ports ranks 1..N-1 serve their heads on (a producer's)."""
        ports = [r.kv_port for r in self.ranks]
        return [p for p in ports if p is not None]

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids (ranks 1..N-1; rank 0 is this process)."""
        return [r.process.pid for r in self.ranks]

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self._check()
        frames = step_message.encode_step(step, self.runner.block_size)
        self._in_step = True
        try:
            for rank in self.ranks:
                rank.control.send_multipart(frames, copy=False)
            return self.runner.execute(step)
        except BaseException as exc:
            if self.failure is None:
                self._blame_a_dead_rank()
            if self.failure is not None:
                raise RankFailure(self.failure) from exc
            self._fail(f"tensor-parallel rank 0 failed a step ({type(exc).__name__}: {exc})")
            raise
        finally:
            self._in_step = False

    def send_kv(self, rank: int, payload: Any) -> None:
        """A KV-transfer command for rank `rank` (>= 1), in order with the steps."""
        self._check()
        self.ranks[rank - 1].control.send_multipart(step_message.encode_kv(payload))

    def close(self) -> None:
        """Stop every rank (SHUTDOWN, then kill past a deadline) and leave the group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for rank in self.ranks:
            if rank.process.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    rank.control.send_multipart([step_message.SHUTDOWN], zmq.NOBLOCK)
        deadline = time.monotonic() + 10.0
        for rank in self.ranks:
            try:
                rank.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel rank %d (pid %d) did not stop; killing it", rank.rank, rank.pid)
                rank.process.kill()
                rank.process.wait()
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(timeout=5)
        with contextlib.suppress(Exception):
            leave_group()
        for rank in self.ranks:
            rank.control.close()
        self._results.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)

    # -- failure ----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise `RankFailure` if a rank failed."""
        self._check()

    def _check(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)

    def _wait(self, event: threading.Event, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not event.wait(_POLL_S):
            self._check()
            if time.monotonic() > deadline:
                self._fail(f"tensor-parallel ranks did not manage {what} within {timeout_s:g} s")
                self._check()

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = message
        log.error("%s; stopping the engine", message)
        for rank in self.ranks:
            if rank.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.process.pid, signal.SIGKILL)
        if self.on_fatal is not None:
            self.on_fatal(message)
            return
        if self._in_step:
            threading.Thread(target=self._exit_if_stuck, name="tp-stuck", daemon=True).start()

    def _blame_a_dead_rank(self) -> None:
        """A collective failed because a peer is gone (gloo raises when its connection drops),
        perhaps before the watchdog saw the process exit: name that rank, not rank 0. The
        socket closes while the process exits, so its exit status follows within moments."""
        deadline = time.monotonic() + BLAME_WAIT_S
        while self.failure is None:
            self._check_ranks()
            if time.monotonic() >= deadline:
                return
            time.sleep(_POLL_S / 10)

    def _exit_if_stuck(self) -> None:
        deadline = time.monotonic() + STUCK_GRACE_S
        while time.monotonic() < deadline:
            if not self._in_step:
                return
            time.sleep(_POLL_S)
        log.error("tensor-parallel rank 0 is stuck in a collective after a rank failed; exiting")
        os._exit(1)

    # -- the watchdog thread ----------------------------------------------------------------
    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        while not self._closing:
            try:
                ready = dict(poller.poll(int(_POLL_S * 1000)))
            except zmq.ZMQError:
                return
            if self._results in ready:
                while True:
                    try:
                        frame = self._results.recv(zmq.NOBLOCK)
                    except (zmq.Again, zmq.ZMQError):
                        break
                    self._on_message(*step_message.decode_result(frame))
            if self.failure is None and not self._closing:
                self._check_ranks()

    def _on_message(self, kind: str, payload: Any) -> None:
        rank = self.ranks[int(payload["rank"]) - 1]
        rank.last_seen = time.monotonic()
        if kind == step_message.HELLO:
            rank.hello = True
            if all(r.hello for r in self.ranks):
                self._ranks_hello.set()
        elif kind == step_message.READY:
            rank.ready = payload["memory"]
            rank.kv_port = payload.get("kv_port")
            if all(r.ready is not None for r in self.ranks):
                self._ranks_ready.set()
        elif kind == step_message.FAILED:
            rank.failed_message = str(payload["message"])
        elif kind == step_message.KV_RESULT and self.kv_result_handler is not None:
            self.kv_result_handler(rank.rank, payload["kv"])

    def _check_ranks(self) -> None:
        now = time.monotonic()
        for rank in self.ranks:
            code = rank.process.poll()
            if code is not None:
                why = f": {rank.failed_message}" if rank.failed_message else ""
                self._fail(f"tensor-parallel rank {rank.rank} (pid {rank.pid}) exited with code {code}{why}")
                return
            if rank.hello and now - rank.last_seen > self.hang_timeout_s:
                self._fail(
                    f"tensor-parallel rank {rank.rank} (pid {rank.pid}) is not responding "
                    f"(no heartbeat for {now - rank.last_seen:.1f} s)"
                )
                return
