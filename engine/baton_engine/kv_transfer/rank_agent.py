"""KV transfer on a tensor-parallel rank >= 1: its own heads, on rank 0's word.

Rank 0's connector decides everything (which request is leased, which is pulled into which
blocks); a rank's agent only moves its own heads' bytes. It runs in the rank process beside
`worker.rank_worker.RankWorker`, which hands it rank 0's KV commands in order with the steps
(so a lease command arrives after the step that wrote the leased blocks ran on this rank):

* ``{"op": "start", "engine_id"}``: rank 0's engine id (pulls must name it).
* ``{"op": "lease", "transfer_id", "block_ids", "seconds"}`` / ``{"op": "release", "transfer_id"}``:
  the producer side, served on this rank's own port (``kv_transfer_port + rank``).
* ``{"op": "pull", "req_id", "params", "dst_block_ids", "skip_blocks"}`` / ``{"op": "cancel", "req_id"}``:
  the consumer side: this rank's heads from the producer ranks holding them; the lease is left
  for rank 0 to end once every rank has pulled.

It reports to rank 0 (`send`, from its own thread) ``{"op": "ended", "transfer_id", "how"}`` when a
lease ends here and ``{"op": "pulled", "req_id", "error"}`` (error: None or [reason, message])
when a pull finished.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from baton_engine.config import EngineConfig
from baton_engine.contract import KVTransferParams
from baton_engine.kv_transfer.consumer import KVTransferConsumer, RankLayout
from baton_engine.kv_transfer.producer import KVTransferProducer
from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often ended leases are looked for while no pull is queued
LEASE_WAIT_S = 10.0
"""How long a pull on this rank waits for a lease rank 0 has not passed on yet."""


@dataclass
class _Pull:
    req_id: int
    params: KVTransferParams
    dst_block_ids: list[int]
    skip_blocks: int
    cancelled: threading.Event = field(default_factory=threading.Event)


class RankTransferAgent:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: torch.Tensor,
        *,
        rank: int,
        num_kv_heads: int,
        send: Callable[[dict[str, Any]], None],
        port: int | None = None,
    ) -> None:
        """`send(payload)`: a result to rank 0 (called on the agent's thread only). `port`:
        the producer's port (default ``kv_transfer_port + rank``; 0: any free port)."""
        self.rank = rank
        self._send = send
        self._device = kv_cache.device
        self.producer: KVTransferProducer | None = None
        self.consumer: KVTransferConsumer | None = None
        if config.kv_role in ("producer", "both"):
            self.producer = KVTransferProducer(
                kv_cache,
                engine_id="",  # no pull is served before rank 0's "start"
                bind_host=config.host,
                port=config.kv_transfer_port + rank if port is None else port,
                kv_key=config.kv_compat_key,
                lease_wait_s=LEASE_WAIT_S,
            )
        if config.kv_role in ("consumer", "both"):
            layout = RankLayout(num_kv_heads, config.tensor_parallel_size, rank)
            self.consumer = KVTransferConsumer(kv_cache, kv_key=config.kv_compat_key, layout=layout)
        self._pulls: queue.SimpleQueue[_Pull | None] = queue.SimpleQueue()
        self._active: dict[int, _Pull] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-rank", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int | None:
        """The port this rank serves its heads on (None: not a producer)."""
        return None if self.producer is None else self.producer.port

    def handle(self, command: dict[str, Any]) -> None:
        """One command of rank 0's (on the rank's main thread, between steps)."""
        op = command["op"]
        if op == "start":
            if self.producer is not None:
                self.producer.engine_id = str(command["engine_id"])
        elif op == "lease" and self.producer is not None:
            if self._device.type != "cpu":
                torch.cuda.synchronize(self._device)  # the step that wrote the blocks
            self.producer.add_lease(
                str(command["transfer_id"]), list(command["block_ids"]), command["seconds"]
            )
        elif op == "release" and self.producer is not None:
            self.producer.release(str(command["transfer_id"]))
        elif op == "pull" and self.consumer is not None:
            pull = _Pull(
                int(command["req_id"]),
                KVTransferParams.from_dict(command["params"]),
                list(command["dst_block_ids"]),
                int(command["skip_blocks"]),
            )
            with self._lock:
                self._active[pull.req_id] = pull
            self._pulls.put(pull)
        elif op == "cancel":
            with self._lock:
                active = self._active.get(int(command["req_id"]))
            if active is not None:
                active.cancelled.set()
        else:
            raise RuntimeError(f"KV command {op!r} for a rank whose kv_role cannot run it")

    def close(self) -> None:
        self._pulls.put(None)
        self._thread.join(timeout=30)
        if self.producer is not None:
            self.producer.close()

    def _run(self) -> None:
        while True:
            try:
                pull = self._pulls.get(timeout=_POLL_S)
            except queue.Empty:
                pull = None
                stop = False
            else:
                stop = pull is None
            if self.producer is not None:
                for transfer_id, how in self.producer.take_ended():
                    self._send({"op": "ended", "transfer_id": transfer_id, "how": how.value})
            if stop:
                return
            if pull is not None:
                self._pull(pull)

    def _pull(self, pull: _Pull) -> None:
        assert self.consumer is not None
        error: list[str] | None = None

        def check_cancel(_index: int) -> None:
            if pull.cancelled.is_set():
                raise KVTransferError(FailureReason.CANCELLED, "request aborted during its pull")

        try:
            check_cancel(0)
            self.consumer.pull(
                pull.params,
                pull.dst_block_ids,
                skip_blocks=pull.skip_blocks,
                on_chunk=check_cancel,
                end_lease=False,
            )
        except KVTransferError as exc:
            error = [exc.reason.value, exc.message]
        except Exception as exc:  # rank 0 must hear back, whatever happened
            log.exception("KV transfer: rank %d's pull of %s crashed", self.rank, pull.params.transfer_id)
            error = [FailureReason.PROTOCOL.value, f"{type(exc).__name__}: {exc}"]
        with self._lock:
            self._active.pop(pull.req_id, None)
        self._send({"op": "pulled", "req_id": pull.req_id, "error": error})
