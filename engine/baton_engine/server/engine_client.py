"""The server's handle on the engine-core process: start it, talk to it, stop it.

Runs inside the server's asyncio loop. Requests go out on a PUSH socket; a reader task
dispatches each step's outputs to the per-request queues (`add` registers one). The core is a
child process (``python -m baton_engine.entrypoints.core_process``); it exits on ``shutdown`` or when this
process dies. If it dies first, every open request fails with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import zmq
import zmq.asyncio

from baton_engine.config import EngineConfig
from baton_engine.core.engine_stats import EngineStats
from baton_engine.core.outputs import RequestOutput
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints import ipc
from baton_engine.entrypoints.cpu_layout import CpuLayout

log = logging.getLogger("baton_engine.server")
LOAD_REPORT_SECONDS = 15.0
"""How often a slow load is reported in the log."""


def core_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine core's environment: the server's, with OpenMP's waiting threads sleeping.

    GNU OpenMP's default lets a thread that waits at the end of a parallel region spin for a
    long while. Beside the server process (tokenizing, streaming) or any other busy process,
    the spinning threads take the cores the working ones need: measured on 2 shared cores, a
    [16 x 576] x [576 x 1536] matmul on 2 threads took 16-35 ms with the default policy and
    1.1 ms with PASSIVE (1 thread: 1.1 ms). An explicit OMP_WAIT_POLICY is kept.
    """
    return {**environ, "OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}


class EngineDeadError(RuntimeError):
    """The engine-core process failed to start or exited."""


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """`on_fatal(reason)`: the core reported that it cannot go on (a tensor-parallel rank
        failed) and exits; the server should stop too."""
        self.config = config
        self.on_stats = on_stats
        self.on_fatal = on_fatal
        self.info: dict[str, Any] = {}
        self.stats = EngineStats()
        self._dead: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._paths = ipc.IpcPaths.create()
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._input.bind(self._paths.input_address)
        self._output.bind(self._paths.output_address)
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineDeadError]] = {}
        self._not_started: set[str] = set()
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @property
    def dead(self) -> str | None:
        """Why the core is gone, or None while it runs. Asks the process itself (a cheap
        ``waitpid``), so that readiness turns false the moment the core exits rather than at the
        watchdog's next poll."""
        if (
            self._dead is None
            and self._tasks
            and self.process is not None
            and self.process.poll() is not None
        ):
            self._dead = f"engine core exited with code {self.process.returncode}"
        return self._dead

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0, layout: CpuLayout | None = None) -> None:
        """Spawn the core and wait for its ``ready`` (or raise `EngineDeadError`). `layout`: the
        core's threads and CPUs on a CPU device (None: torch's defaults, unpinned)."""
        layout_args: list[str] = []
        if layout is not None:
            layout_args = ["--cpu-threads", str(layout.core_threads)]
            if layout.core_cpus is not None:
                layout_args += ["--cpu-affinity", ",".join(map(str, layout.core_cpus))]
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton_engine.entrypoints.core_process",
                "--config-json",
                self.config.model_dump_json(),
                "--input",
                self._paths.input_address,
                "--output",
                self._paths.output_address,
                "--parent-pid",
                str(os.getpid()),
                *layout_args,
            ],
            env=core_environment(os.environ),
        )
        started = time.monotonic()
        deadline = started + timeout
        next_report = started + LOAD_REPORT_SECONDS
        while True:
            if self.process.poll() is not None:
                raise EngineDeadError(f"engine core exited with code {self.process.returncode} while loading")
            now = time.monotonic()
            if now > deadline:
                raise EngineDeadError(f"engine core not ready after {timeout:g} s")
            if now >= next_report:
                log.info("engine core %d still loading (%.0f s)", self.process.pid, now - started)
                next_report = now + LOAD_REPORT_SECONDS
            if await self._output.poll(500):
                kind, payload = ipc.decode(await self._output.recv())
                if kind == ipc.READY:
                    self.info = payload
                    break
                if kind in (ipc.FAILED, ipc.FATAL):
                    raise EngineDeadError(f"engine core failed to load: {payload}")
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="engine-outputs"),
            asyncio.create_task(self._watch_process(), name="engine-watchdog"),
        ]

    async def close(self, timeout: float = 10.0) -> None:
        """Tell the core to stop, wait for it (kill it after `timeout`), release the sockets."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        proc = self.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                await asyncio.wait_for(self._input.send(ipc.encode(ipc.SHUTDOWN, None)), 1.0)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                log.error("engine core %d did not exit in %g s; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._paths.cleanup()

    # -- requests ---------------------------------------------------------------------------
    @property
    def num_not_started(self) -> int:
        """Requests sent to the core that have produced no output yet (queued or prefilling)."""
        return len(self._not_started)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue[RequestOutput | EngineDeadError],
        arrival_time: float,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._queues[request_id] = queue
        self._not_started.add(request_id)
        payload = [request_id, prompt_token_ids, _params_dict(params), arrival_time, kv_transfer_params]
        self._input.send(ipc.encode(ipc.ADD, payload))

    def abort(self, request_ids: list[str], message: str, *, undelivered: bool = False) -> None:
        """Abort in the core (frees KV); outputs still in flight for them are dropped.

        Only requests still open here are sent, unless `undelivered`: their answer will not
        reach the client, so a request whose final output already came (and was never read) is
        aborted too; the core then releases its P/D producer lease."""
        live = [r for r in request_ids if self._queues.pop(r, None) is not None]
        for r in live:
            self._not_started.discard(r)
        aborted = request_ids if undelivered else live
        if aborted and self.dead is None and not self._closed:
            self._input.send(ipc.encode(ipc.ABORT, [aborted, message]))

    def release_transfer(self, request_ids: list[str]) -> None:
        """P/D producer: the response carrying these finished requests' kv_transfer_params was
        not delivered; an abort of a finished request makes the core release its lease."""
        if request_ids and self.dead is None and not self._closed:
            self._input.send(ipc.encode(ipc.ABORT, [request_ids, "kv_transfer_params not delivered"]))

    async def call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility[call_id] = future
        self._input.send(ipc.encode(ipc.UTILITY, [call_id, method, list(args)]))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility.pop(call_id, None)

    # -- background tasks -------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            kind, payload = ipc.decode(await self._output.recv())
            if kind == ipc.OUTPUTS:
                raw_outputs, raw_stats = payload
                for raw in raw_outputs:
                    out = RequestOutput.from_wire(raw)
                    self._not_started.discard(out.request_id)
                    queue = self._queues.get(out.request_id)
                    if queue is None:
                        continue
                    if out.finished:
                        del self._queues[out.request_id]
                    queue.put_nowait(out)
                self.stats = EngineStats.from_dict(raw_stats)
                if self.on_stats is not None:
                    self.on_stats(self.stats)
            elif kind == ipc.UTILITY_RESULT:
                call_id, ok, result = payload
                future = self._utility.get(call_id)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(result)
                    else:
                        future.set_exception(RuntimeError(result))
            elif kind == ipc.FATAL:
                self._dead = f"engine core stopped: {payload}"
                self._fail_open(self._dead)
                if self.on_fatal is not None:
                    self.on_fatal(str(payload))
            else:
                log.error("unexpected message %r from the engine core", kind)

    async def _watch_process(self) -> None:
        assert self.process is not None
        while self.process.poll() is None:
            await asyncio.sleep(0.5)
        reason = self.dead or f"engine core exited with code {self.process.returncode}"
        self._fail_open(reason)

    def _fail_open(self, reason: str) -> None:
        log.error("%s; failing %d open requests", reason, len(self._queues))
        error = EngineDeadError(reason)
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        self._not_started.clear()
        for future in self._utility.values():
            if not future.done():
                future.set_exception(error)


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    raw = asdict(params)
    raw["stop"] = list(params.stop)
    raw["stop_token_ids"] = list(params.stop_token_ids)
    return raw
