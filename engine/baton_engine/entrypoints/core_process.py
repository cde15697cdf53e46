"""The engine core in its own process: ``python -m baton_engine.entrypoints.core_process ...``.

Started by the server (`baton_engine.server.engine_client`), it loads the model, reports
``ready`` and runs the step loop, reading add/abort/utility messages between steps (see
`baton_engine.entrypoints.ipc` for the wire). It exits when told to (``shutdown``), when its parent process
is gone (checked every `PARENT_CHECK_SECONDS`), and ignores SIGINT/SIGTERM so that a signal sent
to the whole process group lets the server drain in-flight requests first.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import RequestOutput
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints import ipc
from baton_engine.entrypoints.engine_factory import close_runner
from baton_engine.model.config import UnsupportedArchitectureError
from baton_engine.model.loader.reference import ModelNotFoundError
from baton_engine.model.parallel import TensorParallelShapeError
from baton_engine.worker.distributed import TensorParallelDeviceError
from baton_engine.worker.tp_executor import RankFailure

log = logging.getLogger("baton_engine.core")

PARENT_CHECK_SECONDS = 1.0
IDLE_POLL_MS = 200


@dataclass
class _LoopState:
    shutdown: bool = False
    was_busy: bool = False
    utility_results: list[list[Any]] = field(default_factory=list)
    rejected: list[RequestOutput] = field(default_factory=list)
    vocab_size: int | None = None
    """Token ids must be below it (the server checks first; a bad id would fail the forward)."""


def _handle(core: EngineCore, kind: str, payload: Any, state: _LoopState) -> None:
    if kind == ipc.ADD:
        request_id, prompt_ids, params, arrival, *rest = payload
        kv_transfer_params = rest[0] if rest else None
        try:
            vocab = state.vocab_size
            bad = None if vocab is None else next((t for t in prompt_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
            core.add_request(
                request_id,
                prompt_ids,
                SamplingParams(**params),
                arrival_time=arrival,
                kv_transfer_params=kv_transfer_params,
            )
        except ValueError as exc:  # the server validates first; this is a last line of defence
            log.error("rejected request %s: %s", request_id, exc)
            state.rejected.append(
                RequestOutput(
                    request_id, [], finished=True, finish_reason="rejected", finish_message=str(exc)
                )
            )
    elif kind == ipc.ABORT:
        request_ids, message = payload
        core.abort_requests(request_ids, message)
    elif kind == ipc.UTILITY:
        call_id, method, _args = payload
        if method == "stats":
            state.utility_results.append([call_id, True, core.stats().to_dict()])
        elif method == "release_transfer":
            engine_id, transfer_id = _args
            state.utility_results.append([call_id, True, core.release_transfer(engine_id, transfer_id)])
        elif method == "reset_prefix_cache":
            core.scheduler.reset_prefix_cache()
            state.utility_results.append([call_id, True, None])
        else:
            state.utility_results.append([call_id, False, f"unknown utility method {method!r}"])
    elif kind == ipc.SHUTDOWN:
        state.shutdown = True
    else:
        log.error("unknown message kind %r", kind)


def serve_core(
    core: EngineCore,
    pull: zmq.Socket[bytes],
    push: zmq.Socket[bytes],
    parent_pid: int,
    vocab_size: int | None = None,
) -> None:
    """The core's loop; returns on shutdown or when the parent is gone."""
    state = _LoopState(vocab_size=vocab_size)
    next_parent_check = time.monotonic() + PARENT_CHECK_SECONDS
    while not state.shutdown:
        now = time.monotonic()
        if now >= next_parent_check:
            if os.getppid() != parent_pid:
                log.error("parent process %d is gone; exiting", parent_pid)
                return
            next_parent_check = now + PARENT_CHECK_SECONDS
        busy = core.has_unfinished()
        if pull.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    frame = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind, payload = ipc.decode(frame)
                _handle(core, kind, payload, state)
        for result in state.utility_results:
            push.send(ipc.encode(ipc.UTILITY_RESULT, result))
        state.utility_results.clear()
        if state.rejected:
            push.send(
                ipc.encode(ipc.OUTPUTS, [[o.to_wire() for o in state.rejected], core.stats().to_dict()])
            )
            state.rejected.clear()
        if core.has_unfinished():
            outputs = core.step()
            state.was_busy = True
            if outputs:
                push.send(ipc.encode(ipc.OUTPUTS, [[o.to_wire() for o in outputs], core.stats().to_dict()]))
        elif state.was_busy:
            state.was_busy = False
            push.send(ipc.encode(ipc.OUTPUTS, [[], core.stats().to_dict()]))
        elif core.poll_kv_transfer():  # idle: free ended producer leases, report transfers
            push.send(ipc.encode(ipc.OUTPUTS, [[], core.stats().to_dict()]))


def _start_kv_event_publisher(config: EngineConfig, model_name: str) -> Any:
    """The KV-event publisher (PUB + replay ROUTER) when ``--kv-events`` is on, else None.

    Binds the pod's own address (`contract.ENV_POD_IP`, else ``--host``): on the local control
    plane several pods share one machine on different loopback addresses and the same ports.
    """
    if not config.kv_events:
        return None
    from baton_engine import contract
    from baton_engine.prefix.publisher import KVEventPublisher

    address = os.environ.get(contract.ENV_POD_IP) or config.host
    publisher = KVEventPublisher(
        f"tcp://{address}:{config.kv_events_port}",
        contract.kv_events_topic(address, model_name),
        replay_endpoint=f"tcp://{address}:{config.kv_events_replay_port}",
        buffer_steps=config.kv_events_buffer_steps,
        sndhwm=config.kv_events_hwm,
        encoding=config.kv_events_encoding,
    )
    log.info(
        "publishing KV events (%s encoding) on %s (replay %s)",
        publisher.encoding,
        publisher.endpoint,
        publisher.replay_endpoint,
    )
    return publisher


_SELF_EXPLAINING_ERRORS = (
    ModelNotFoundError,
    UnsupportedArchitectureError,
    FileNotFoundError,
    TensorParallelShapeError,
    TensorParallelDeviceError,
    RankFailure,
)

RANK_FAILED_EXIT_CODE = 3
"""The core's exit code when a tensor-parallel rank failed."""


FATAL_LINGER_MS = 2000
"""How long the core waits for `ipc.FATAL` to reach the server before it exits anyway."""


def _exit_on_rank_failure(output: str) -> Callable[[str], None]:
    """Tell the server (`ipc.FATAL`) and exit at once: the main thread may be stuck in a
    collective with the rank that is gone. The message goes through a context of its own,
    terminated before the exit: that is what flushes it (``os._exit`` would drop a message still
    queued in a context's I/O thread), and the main context's sockets would block a `term`."""

    def on_failure(message: str) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, FATAL_LINGER_MS)
        sock.connect(output)
        sock.send(ipc.encode(ipc.FATAL, message))
        sock.close()
        ctx.term()
        logging.shutdown()
        os._exit(RANK_FAILED_EXIT_CODE)

    return on_failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Baton engine core (started by the server).")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--input", required=True, help="ipc:// address to read requests from")
    parser.add_argument("--output", required=True, help="ipc:// address to send outputs to")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--cpu-threads", type=int, help="torch intra-op threads (CPU device)")
    parser.add_argument("--cpu-affinity", help="comma-separated CPUs to run on (CPU device)")
    args = parser.parse_args(argv)
    if args.cpu_affinity:  # before torch starts its OpenMP threads, which inherit the mask
        os.sched_setaffinity(0, [int(cpu) for cpu in args.cpu_affinity.split(",")])
    if args.cpu_threads:
        import torch

        torch.set_num_threads(args.cpu_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s core: %(message)s")

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(args.input)
    push.connect(args.output)
    push.setsockopt(zmq.LINGER, 2000)
    pull.setsockopt(zmq.LINGER, 0)
    started = time.monotonic()
    try:
        from baton_engine.entrypoints.engine_factory import build_engine_core

        config = EngineConfig.model_validate_json(args.config_json)
        log.info("engine core %d: loading %s on %s", os.getpid(), config.model, config.device)
        core, info = build_engine_core(config, on_rank_failure=_exit_on_rank_failure(args.output))
        publisher = _start_kv_event_publisher(config, info.name)
        if publisher is not None:
            core.kv_event_sink = publisher.publish
    except Exception as exc:  # report any loading failure to the server, then exit
        if isinstance(exc, _SELF_EXPLAINING_ERRORS):
            log.error("engine core failed to start: %s", exc)  # the message says it all
        else:
            log.exception("engine core failed to start")
        push.send(ipc.encode(ipc.FAILED, f"{type(exc).__name__}: {exc}"))
        push.close()
        pull.close()
        ctx.term()
        return 1
    log.info(
        "engine core ready in %.1f s: %d KV blocks of %d tokens, max_model_len %d",
        time.monotonic() - started, core.scheduler.kv_cache_manager.num_blocks, core.scheduler.block_size,
        info.max_model_len,
    )  # fmt: skip
    push.send(
        ipc.encode(
            ipc.READY,
            {
                "num_kv_blocks": core.scheduler.kv_cache_manager.num_blocks,
                "max_model_len": info.max_model_len,
                "block_size": core.scheduler.block_size,
                "pid": os.getpid(),
                "model_name": info.name,
                "eos_token_ids": list(info.eos_token_ids),
                "vocab_size": info.vocab_size,
            },
        )
    )
    try:
        serve_core(core, pull, push, args.parent_pid, info.vocab_size)
    finally:
        if publisher is not None:
            publisher.shutdown()
        close_runner(core)
        push.close()
        pull.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
