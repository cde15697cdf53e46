"""Tensor-parallel ranks 1..N-1: run every step rank 0 sends, until it says stop.

A rank mirrors rank 0's runner exactly: for each step with tokens it runs `compute_logits`
(the forward, its half of every all-reduce and the logits all-gather), which rank 0's
`execute` runs once per such step too; the logits are rank 0's to sample, so the rank drops
them. A rank never schedules anything: its only input is the control socket.

`Heartbeat` tells rank 0 the process is alive (its own thread and socket), so a rank that
stops responding is noticed even while rank 0 waits inside a collective.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from baton_engine.worker import step_message
from baton_engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

KVHandler = Callable[[Any], None]
"""Runs one KV-transfer command (``[KV, payload]``) on this rank (its transfer agent)."""


class RankWorker:
    def __init__(
        self, runner: ModelRunner, control: zmq.Socket[bytes], kv_handler: KVHandler | None = None
    ) -> None:
        self.runner = runner
        self.control = control
        self.kv_handler = kv_handler
        self.num_steps = 0

    def serve(self) -> None:
        """Run commands until SHUTDOWN."""
        with torch.inference_mode():
            while True:
                frames = self.control.recv_multipart()
                kind = frames[0]
                if kind == step_message.STEP:
                    step = step_message.decode_step(frames[1:])
                    if step.num_tokens:
                        self.runner.compute_logits(step)
                    self.num_steps += 1
                elif kind == step_message.KV:
                    if self.kv_handler is None:
                        raise RuntimeError("a KV-transfer command reached a rank without a transfer agent")
                    self.kv_handler(msgpack.unpackb(frames[1], raw=False))
                elif kind == step_message.SHUTDOWN:
                    log.info("shutting down after %d steps", self.num_steps)
                    return
                else:
                    raise RuntimeError(f"unknown control message {bytes(kind[:16])!r}")


class Heartbeat:
    """Sends ``heartbeat`` {rank} to rank 0 every `step_message.HEARTBEAT_S` from its own thread."""

    def __init__(self, ctx: zmq.Context[Any], address: str, rank: int) -> None:
        self._socket = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 4)
        self._socket.connect(address)
        self._rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        message = step_message.encode_result(step_message.HEARTBEAT, {"rank": self._rank})
        while not self._stop.wait(step_message.HEARTBEAT_S):
            try:
                self._socket.send(message, zmq.NOBLOCK)
            except zmq.Again:
                pass  # rank 0 is not reading (busy or gone): the next beat will do

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
