"""A tensor-parallel rank >= 1 in its own process: ``python -m baton_engine.entrypoints.rank_process``.

Started by rank 0 (`worker.tp_executor.TensorParallelExecutor`, in the engine core's process).
It dies with its parent (``PR_SET_PDEATHSIG``, and a parent check for platforms without it),
ignores SIGINT/SIGTERM (rank 0 stops it with SHUTDOWN), says ``hello``, joins the group, loads
its shard and KV cache, says ``ready`` with its memory, then runs rank 0's steps
(`worker.rank_worker.RankWorker`). On an error it reports ``failed`` and exits 1. Either way it
leaves through `os._exit` once everything is closed (`_exit`).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import zmq

from baton_engine.config import EngineConfig

if TYPE_CHECKING:
    from baton_engine.kv_transfer.rank_agent import RankTransferAgent
    from baton_engine.worker.model_runner import ModelRunner

log = logging.getLogger("baton_engine.rank")

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent check below still catches most
        pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def _transfer_agent(
    ctx: zmq.Context[Any], results_address: str, config: EngineConfig, runner: ModelRunner, rank: int
) -> tuple[RankTransferAgent, zmq.Socket[bytes]]:
    """This rank's KV-transfer agent, reporting to rank 0 on its own socket (its own thread),
    and that socket (to close after the agent: an open socket would block the context's term)."""
    import threading

    from baton_engine.kv_transfer.rank_agent import RankTransferAgent
    from baton_engine.worker import step_message

    socket = ctx.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(results_address)
    lock = threading.Lock()

    def send(payload: dict[str, Any]) -> None:
        with lock:
            socket.send(step_message.encode_result(step_message.KV_RESULT, {"rank": rank, "kv": payload}))

    agent = RankTransferAgent(
        config, runner.kv_cache, rank=rank, num_kv_heads=runner.model_config.num_kv_heads, send=send
    )
    return agent, socket


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Baton tensor-parallel rank (started by rank 0).")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--control", required=True, help="ipc:// address of rank 0's commands")
    parser.add_argument("--results", required=True, help="ipc:// address of rank 0's results socket")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = args.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")

    from baton_engine.worker import step_message
    from baton_engine.worker.rank_worker import Heartbeat, RankWorker

    ctx: zmq.Context[Any] = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(args.results)
    control = ctx.socket(zmq.PULL)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(args.control)
    heartbeat = Heartbeat(ctx, args.results, rank)
    agent: RankTransferAgent | None = None
    agent_results: zmq.Socket[bytes] | None = None
    code = 0
    try:
        from baton_engine.entrypoints.engine_factory import build_model_runner
        from baton_engine.worker.distributed import connect_store, join_group, rank_device
        from baton_engine.worker.memory import process_memory

        config = EngineConfig.model_validate_json(args.config_json)
        size = config.tensor_parallel_size
        device = rank_device(config.device, rank)
        results.send(step_message.encode_result(step_message.HELLO, {"rank": rank, "pid": os.getpid()}))
        parallel = join_group(connect_store(args.store_port, size), rank, size, device)
        runner = build_model_runner(config, parallel=parallel)
        if config.kv_role != "none":
            agent, agent_results = _transfer_agent(ctx, args.results, config, runner, rank)
        memory = process_memory(device)
        ready = {"rank": rank, "memory": memory, "kv_port": None if agent is None else agent.port}
        results.send(step_message.encode_result(step_message.READY, ready))
        RankWorker(runner, control, None if agent is None else agent.handle).serve()
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed", rank)
        message = f"{type(exc).__name__}: {exc}"
        results.send(step_message.encode_result(step_message.FAILED, {"rank": rank, "message": message}))
        code = 1
    finally:
        if agent is not None:
            agent.close()
        if agent_results is not None:
            agent_results.close()
        heartbeat.stop()
        control.close()
        results.close()
        ctx.term()
    return code


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: `main` has closed every socket and terminated
    its context, so nothing is left to flush but the log. The teardown (torch's modules and
    thread pools) took seconds per rank on a loaded machine (measured: 8 s for three ranks at
    load 16, 0.6 s this way), past rank 0's shutdown deadline, which then kills the ranks."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
