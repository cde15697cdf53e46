"""Producer (prefill) side: serves pulls of leased blocks from a ZMQ ROUTER on one thread.

The step loop calls `add_lease` when a prefilled request finishes (its blocks stay allocated),
`release` when that request's client goes away, and `take_ended` every step to free the blocks
of leases that ended (DONE, RELEASE or expiry). Blocks are read only while their lease is held
and marked busy, and the step loop frees them only after `take_ended` reported the lease, so a
read never races with the step loop reusing a block.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Any

import torch
import zmq

from baton_engine.kv_transfer import protocol
from baton_engine.kv_transfer.cache_blocks import BlockGatherer, cache_spec
from baton_engine.kv_transfer.leases import Lease, LeaseEnd, LeaseTable
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.protocol import CacheSpec, FailureReason, Kind

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
_POLL_CAP_S = 0.05  # the longest the serving thread sleeps before checking expiry and stop


class _ConsumerGone(Exception):
    pass


class KVTransferProducer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        engine_id: str,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        stats: TransferStats | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        send_depth: int = 4,
        send_timeout_s: float = 10.0,
        context: zmq.Context[Any] | None = None,
        kv_key: str = "",
        lease_wait_s: float = 0.0,
    ) -> None:
        """Bind the ROUTER on ``bind_host:port`` (port 0: any free port, see `port`). Pulls from
        a consumer whose KV-compatibility key is not `kv_key` are refused. `lease_wait_s`: how
        long a pull of a lease not added yet waits for it (tensor-parallel ranks >= 1, whose
        leases come from rank 0)."""
        self.engine_id = engine_id
        self.lease_wait_s = lease_wait_s
        self.kv_key = kv_key
        self.spec: CacheSpec = cache_spec(kv_cache)
        self.num_blocks = kv_cache.shape[2]
        self.stats = stats if stats is not None else TransferStats()
        self.leases = LeaseTable()
        self.send_timeout_s = send_timeout_s
        chunk_blocks = max(1, chunk_bytes // self.spec.block_bytes)
        self._gatherer = BlockGatherer(kv_cache, chunk_blocks, max(3, send_depth))
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Unknown or vanished peers raise instead of being dropped silently, and a full pipe
        # blocks the send (up to SNDTIMEO) instead of dropping chunks.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, send_depth)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                self._sock.bind(f"tcp://{bind_host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            raise OSError(f"KV transfer: cannot bind tcp://{bind_host}:{port}: {exc}") from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-producer", daemon=True)
        self._thread.start()

    # -- step-loop side ---------------------------------------------------------------------
    def add_lease(self, transfer_id: str, block_ids: list[int], lease_seconds: float) -> float:
        """Keep `block_ids` readable under `transfer_id`; returns the expiry as unix time."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block id {bad[0]} outside the cache's [0, {self.num_blocks})")
        self.leases.add(transfer_id, block_ids, lease_seconds)
        return time.time() + lease_seconds

    def release(self, transfer_id: str) -> bool:
        """End a lease early (the request's client went away). False if there is none."""
        return self.leases.end(transfer_id, LeaseEnd.RELEASED)

    def take_ended(self) -> list[tuple[str, LeaseEnd]]:
        """Leases that ended since the last call; free their blocks now."""
        return self.leases.take_ended()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(linger=0)

    # -- serving thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            wait = self.leases.seconds_to_next_expiry()
            wait = _POLL_CAP_S if wait is None else min(wait, _POLL_CAP_S)
            if poller.poll(int(wait * 1000) + 1):
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception:  # one bad message must never stop the server
                        log.exception("KV transfer: error handling a message")
            expired = self.leases.expire(on_expired=self.stats.lease_expired)
            if expired:
                log.info("KV transfer: %d lease(s) expired unpulled: %s", len(expired), expired)

    def _handle(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            kind, header = protocol.decode(body)
        except ValueError as exc:
            self._reply_error(ident, {}, FailureReason.BAD_REQUEST, str(exc))
            return
        if kind is Kind.PULL:
            self._handle_pull(ident, header)
        elif kind in (Kind.DONE, Kind.RELEASE):
            self._handle_end(ident, kind, header)
        else:
            self._reply_error(ident, header, FailureReason.PROTOCOL, f"{kind.name} is not a request")

    def _check_request(self, header: dict[str, Any]) -> tuple[FailureReason, str] | None:
        for name in ("pull_id", "transfer_id", "engine_id"):
            if not isinstance(header.get(name), str):
                return FailureReason.BAD_REQUEST, f"{name}: missing or not a string"
        if header["engine_id"] != self.engine_id:
            return (
                FailureReason.ENGINE_MISMATCH,
                f"transfer issued by engine {header['engine_id']!r}, this is engine {self.engine_id!r} "
                "(the producer restarted)",
            )
        return None

    def _handle_end(self, ident: bytes, kind: Kind, header: dict[str, Any]) -> None:
        problem = self._check_request(header)
        if problem is not None:
            self._reply_error(ident, header, *problem)
            return
        how = LeaseEnd.DONE if kind is Kind.DONE else LeaseEnd.RELEASED
        if self.leases.end(header["transfer_id"], how):
            self._reply(ident, Kind.ACK, {"pull_id": header["pull_id"], "transfer_id": header["transfer_id"]})
        else:
            self._reply_error(
                ident, header, FailureReason.UNKNOWN_TRANSFER, f"no lease {header['transfer_id']!r} to end"
            )

    def _handle_pull(self, ident: bytes, header: dict[str, Any]) -> None:
        problem = self._check_request(header)
        if problem is not None:
            self._reply_error(ident, header, *problem)
            return
        theirs_key = header.get("kv_key", "")
        if theirs_key != self.kv_key:
            self.stats.failed(FailureReason.KV_KEY_MISMATCH.value)
            message = f"producer KV-compatibility key {self.kv_key!r} != consumer's {theirs_key!r}"
            self._reply_error(ident, header, FailureReason.KV_KEY_MISMATCH, message)
            return
        try:
            theirs = protocol.CacheSpec.from_dict(header.get("spec"))
        except ValueError as exc:
            self._reply_error(ident, header, FailureReason.BAD_REQUEST, str(exc))
            return
        raw_heads = header.get("heads")
        heads: tuple[int, int] | None = None
        spec = self.spec
        if raw_heads is not None:
            if not (
                isinstance(raw_heads, list)
                and len(raw_heads) == 2
                and all(isinstance(h, int) and not isinstance(h, bool) for h in raw_heads)
            ):
                self._reply_error(ident, header, FailureReason.BAD_REQUEST, "heads: must be [first, count]")
                return
            if not (
                0 <= raw_heads[0] and 1 <= raw_heads[1] and raw_heads[0] + raw_heads[1] <= spec.num_kv_heads
            ):
                message = f"heads {raw_heads}: outside this rank's {spec.num_kv_heads} KV heads"
                self._reply_error(ident, header, FailureReason.SPEC_MISMATCH, message)
                return
            heads = (raw_heads[0], raw_heads[1])
            spec = dataclasses.replace(spec, num_kv_heads=heads[1])
        diff = spec.mismatch(theirs)
        if diff is not None:
            self._reply_error(ident, header, FailureReason.SPEC_MISMATCH, f"producer vs consumer: {diff}")
            return
        ids = header.get("block_ids")
        if not isinstance(ids, list) or not all(isinstance(b, int) for b in ids):
            self._reply_error(ident, header, FailureReason.BAD_REQUEST, "block_ids: must be a list of ints")
            return
        transfer_id = header["transfer_id"]
        lease = self.leases.acquire(transfer_id)
        if lease is FailureReason.UNKNOWN_TRANSFER and self.lease_wait_s > 0:
            self.leases.wait_added(transfer_id, self.lease_wait_s)
            lease = self.leases.acquire(transfer_id)
        if isinstance(lease, FailureReason):
            self._reply_error(ident, header, lease, f"transfer {transfer_id!r}: {lease.value}")
            return
        try:
            outside = sorted(set(ids) - set(lease.block_ids))
            if outside:
                self._reply_error(
                    ident, header, FailureReason.BAD_REQUEST, f"block_ids: {outside[0]} is not in the lease"
                )
                return
            self._send_blocks(ident, header["pull_id"], lease, ids, spec, heads)
        except _ConsumerGone as exc:
            self.stats.failed("consumer_gone")
            log.warning("KV transfer %s: consumer went away mid-send: %s", transfer_id, exc)
        finally:
            self.leases.done_reading(lease)

    def _send_blocks(
        self,
        ident: bytes,
        pull_id: str,
        lease: Lease,
        ids: list[int],
        spec: CacheSpec,
        heads: tuple[int, int] | None,
    ) -> None:
        started = time.perf_counter()
        g = self._gatherer
        parts = [ids[i : i + g.chunk_blocks] for i in range(0, len(ids), g.chunk_blocks)]
        self._reply(
            ident,
            Kind.META,
            {
                "pull_id": pull_id,
                "transfer_id": lease.transfer_id,
                "num_chunks": len(parts),
                "num_blocks": len(ids),
                "spec": spec.to_dict(),
            },
        )
        trackers: list[zmq.MessageTracker | None] = [None] * g.depth
        staged: deque[tuple[int, int, int, torch.Tensor]] = deque()  # slot, index, first, host

        def send_next() -> None:
            slot, index, first, host = staged.popleft()
            g.wait(slot)
            header = {"pull_id": pull_id, "index": index, "first": first, "count": host.shape[2]}
            trackers[slot] = self._send(
                ident, [*protocol.encode(Kind.DATA, header), host.numpy().data.cast("B")]
            )

        first = 0
        for index, part in enumerate(parts):
            slot = index % g.depth
            previous = trackers[slot]
            if previous is not None:
                try:
                    previous.wait(self.send_timeout_s)
                except zmq.NotDone:
                    raise _ConsumerGone(f"chunk not sent within {self.send_timeout_s}s") from None
            staged.append((slot, index, first, g.start(slot, part, heads)))
            first += len(part)
            if len(staged) > 1:  # keep one chunk staging while the previous one is sent
                send_next()
        while staged:
            send_next()
        self.stats.sent(len(ids) * spec.block_bytes, time.perf_counter() - started)

    def _send(self, ident: bytes, frames: list[Any]) -> zmq.MessageTracker:
        try:
            tracker = self._sock.send_multipart([ident, *frames], copy=False, track=True)
            assert tracker is not None  # track=True always returns one
            return tracker
        except zmq.Again:
            raise _ConsumerGone(f"send blocked for {self.send_timeout_s}s") from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise _ConsumerGone("peer disconnected") from None
            raise

    def _reply(self, ident: bytes, kind: Kind, header: dict[str, Any]) -> None:
        try:
            self._sock.send_multipart([ident, *protocol.encode(kind, header)])
        except zmq.Again:
            raise _ConsumerGone(f"send blocked for {self.send_timeout_s}s") from None
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.info("KV transfer: %s reply to a consumer that has gone", kind.name)

    def _reply_error(self, ident: bytes, header: dict[str, Any], reason: FailureReason, message: str) -> None:
        pull_id = header.get("pull_id") if isinstance(header.get("pull_id"), str) else ""
        transfer_id = header.get("transfer_id") if isinstance(header.get("transfer_id"), str) else ""
        try:
            self._reply(
                ident,
                Kind.ERR,
                {"pull_id": pull_id, "transfer_id": transfer_id, "reason": reason.value, "message": message},
            )
        except _ConsumerGone:
            pass
