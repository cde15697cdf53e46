"""Consumer (decode) side: pulls a producer's leased blocks into this engine's own blocks.

One `KVTransferConsumer` is used by one thread. Each pull opens its own DEALER to the producer
(so no late reply of an abandoned pull can be mistaken for a new one) and watches it with a
socket monitor: a refused connection or a connection lost mid-transfer fails the pull at once;
every other wait has a deadline.

The caller must have verified the signed params (`params.verify_params`) before calling `pull`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from baton_engine.contract import KVTransferParams
from baton_engine.kv_transfer import protocol
from baton_engine.kv_transfer.cache_blocks import BlockScatterer, check_block_ids
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.protocol import FailureReason, Kind, KVTransferError

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
_RELEASE_LINGER_MS = 500
# After these the producer no longer holds (or never held) the lease: nothing to release.
_NOTHING_HELD = {
    FailureReason.UNKNOWN_TRANSFER,
    FailureReason.LEASE_EXPIRED,
    FailureReason.ENGINE_MISMATCH,
    FailureReason.PRODUCER_UNREACHABLE,
    FailureReason.PRODUCER_GONE,
}


@dataclass(frozen=True)
class PullResult:
    num_blocks: int
    num_bytes: int
    seconds: float  # PULL sent -> DONE acknowledged


def endpoint(params: KVTransferParams) -> str:
    host = f"[{params.host}]" if ":" in params.host else params.host
    return f"tcp://{host}:{params.port}"


class _Channel:
    """One DEALER to one producer plus its monitor, for one pull."""

    def __init__(self, ctx: zmq.Context[Any], address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(_MONITOR_EVENTS)
        self.sock.connect(address)
        self.connected = False
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def send(self, kind: Kind, header: dict[str, Any]) -> None:
        self.sock.send_multipart(protocol.encode(kind, header))

    def recv(self, pull_id: str) -> tuple[Kind, dict[str, Any], list[zmq.Frame]]:
        """The next reply of pull `pull_id`; raises KVTransferError on loss, timeout or ERR."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(
                    FailureReason.TIMEOUT, f"no reply from {self.address} within {self.timeout_s}s"
                )
            ready = dict(self.poller.poll(int(left * 1000) + 1))
            if self.monitor in ready:
                self._check_connection()
            if self.sock not in ready:
                continue
            frames = self.sock.recv_multipart(copy=False)
            try:
                kind, header = protocol.decode([f.bytes for f in frames[:3]])
            except ValueError as exc:
                problem = f"bad reply from {self.address}: {exc}"
                raise KVTransferError(FailureReason.PROTOCOL, problem) from None
            if header.get("pull_id") != pull_id:
                continue  # cannot happen on a fresh socket; ignore rather than misattribute
            if kind is Kind.ERR:
                try:
                    reason = FailureReason(str(header.get("reason")))
                except ValueError:
                    reason = FailureReason.PROTOCOL
                raise KVTransferError(reason, f"producer {self.address}: {header.get('message', '')}")
            return kind, header, frames

    def _check_connection(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                raise KVTransferError(FailureReason.PRODUCER_GONE, f"connection to {self.address} lost")
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED and not self.connected:
                raise KVTransferError(
                    FailureReason.PRODUCER_UNREACHABLE, f"cannot connect to {self.address} (refused)"
                )

    def close(self, linger_ms: int = 0) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class KVTransferConsumer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        stats: TransferStats | None = None,
        timeout_s: float = 10.0,
        context: zmq.Context[Any] | None = None,
        kv_key: str = "",
    ) -> None:
        """`kv_key`: this engine's KV-compatibility key; params carrying another are refused."""
        self.kv_key = kv_key
        self._scatterer = BlockScatterer(kv_cache)
        self.spec = self._scatterer.spec
        self.stats = stats if stats is not None else TransferStats()
        self.timeout_s = timeout_s
        self._ctx = context if context is not None else zmq.Context.instance()

    def check_params(self, params: KVTransferParams) -> None:
        """Raise KV_KEY_MISMATCH if the producer's KV-compatibility key is not ours, SPEC_MISMATCH
        if its cache cannot fill ours (both before any connection)."""
        if params.kv_key != self.kv_key:
            raise KVTransferError(
                FailureReason.KV_KEY_MISMATCH,
                f"kv_transfer_params.kv_key: the producer's KV-compatibility key {params.kv_key!r} is "
                f"not this engine's {self.kv_key!r} (they differ in model, KV dtype, block size, "
                "parallel layout or prefix hash); refusing to pull",
            )
        diffs = [
            f"{name} {mine!r} != {theirs!r}"
            for name, mine, theirs in (
                ("block_size", self.spec.block_size, params.block_size),
                ("dtype", self.spec.dtype, params.dtype),
                ("layout", self.spec.layout, params.layout),
            )
            if mine != theirs
        ]
        if diffs:
            raise KVTransferError(FailureReason.SPEC_MISMATCH, "consumer vs producer: " + ", ".join(diffs))

    def pull(
        self,
        params: KVTransferParams,
        dst_block_ids: list[int],
        *,
        skip_blocks: int = 0,
        on_chunk: Callable[[int], None] | None = None,
    ) -> PullResult:
        """Pull the producer's blocks ``params.block_ids[skip_blocks:]`` into `dst_block_ids`.

        `skip_blocks` is this engine's own prefix-cache hit, in blocks. On success the producer
        has released its lease; on failure a RELEASE is sent where the producer may still hold
        it. Raises KVTransferError (and records its reason); `on_chunk(index)` runs after each
        chunk is written (tests use it to act mid-transfer).
        """
        wanted = params.block_ids[skip_blocks:]
        if not 0 <= skip_blocks <= len(params.block_ids):
            raise ValueError(f"skip_blocks={skip_blocks} outside [0, {len(params.block_ids)}]")
        if len(dst_block_ids) != len(wanted):
            raise ValueError(
                f"{len(dst_block_ids)} destination blocks for {len(wanted)} source blocks "
                f"({len(params.block_ids)} minus {skip_blocks} already cached)"
            )
        check_block_ids(dst_block_ids, self._scatterer.num_blocks, "dst_block_ids")
        started = time.perf_counter()
        try:
            self.check_params(params)
        except KVTransferError as exc:
            self.stats.failed(exc.reason.value)
            if exc.reason is FailureReason.KV_KEY_MISMATCH:
                # Signed by this deployment but never to be pulled here: let the producer free
                # the blocks now rather than at lease expiry.
                self.release(params)
            raise
        try:
            channel = _Channel(self._ctx, endpoint(params), self.timeout_s)
        except KVTransferError as exc:
            self.stats.failed(exc.reason.value)
            raise
        pull_id = uuid.uuid4().hex
        linger = 0
        try:
            if wanted:
                self._transfer(channel, pull_id, params, wanted, dst_block_ids, on_chunk)
            channel.send(Kind.DONE, self._ids(params, pull_id))
            channel.recv(pull_id)  # ACK
        except KVTransferError as exc:
            self.stats.failed(exc.reason.value)
            if exc.reason not in _NOTHING_HELD:
                channel.send(Kind.RELEASE, self._ids(params, uuid.uuid4().hex))
                linger = _RELEASE_LINGER_MS
            raise
        finally:
            channel.close(linger)
        seconds = time.perf_counter() - started
        nbytes = len(wanted) * self.spec.block_bytes
        self.stats.received(nbytes, seconds)
        return PullResult(num_blocks=len(wanted), num_bytes=nbytes, seconds=seconds)

    def release(self, params: KVTransferParams) -> bool:
        """Tell the producer to drop a lease this engine will not pull (request aborted).
        True if the producer acknowledged it."""
        channel = _Channel(self._ctx, endpoint(params), self.timeout_s)
        pull_id = uuid.uuid4().hex
        try:
            channel.send(Kind.RELEASE, self._ids(params, pull_id))
            channel.recv(pull_id)
            return True
        except KVTransferError:
            return False
        finally:
            channel.close()

    @staticmethod
    def _ids(params: KVTransferParams, pull_id: str) -> dict[str, Any]:
        return {"pull_id": pull_id, "transfer_id": params.transfer_id, "engine_id": params.engine_id}

    def _transfer(
        self,
        channel: _Channel,
        pull_id: str,
        params: KVTransferParams,
        wanted: list[int],
        dst: list[int],
        on_chunk: Callable[[int], None] | None,
    ) -> None:
        request = {
            **self._ids(params, pull_id),
            "block_ids": wanted,
            "spec": self.spec.to_dict(),
            "kv_key": self.kv_key,
        }
        channel.send(Kind.PULL, request)
        kind, meta, _ = channel.recv(pull_id)
        if kind is not Kind.META:
            raise KVTransferError(FailureReason.PROTOCOL, f"expected META, got {kind.name}")
        try:
            theirs = protocol.CacheSpec.from_dict(meta.get("spec"))
        except ValueError as exc:
            raise KVTransferError(FailureReason.PROTOCOL, f"META: {exc}") from None
        diff = self.spec.mismatch(theirs)
        if diff is not None:
            raise KVTransferError(FailureReason.SPEC_MISMATCH, f"consumer vs producer: {diff}")
        if meta.get("num_blocks") != len(wanted):
            raise KVTransferError(
                FailureReason.PROTOCOL, f"META announces {meta.get('num_blocks')} blocks, asked {len(wanted)}"
            )
        written = 0
        for index in range(int(meta["num_chunks"])):
            kind, header, frames = channel.recv(pull_id)
            if kind is not Kind.DATA or len(frames) != 4:
                raise KVTransferError(FailureReason.PROTOCOL, f"expected DATA chunk {index}, got {kind.name}")
            first, count = header.get("first"), header.get("count")
            if header.get("index") != index or first != written or not isinstance(count, int) or count < 1:
                raise KVTransferError(FailureReason.PROTOCOL, f"chunk {index} out of order: {header}")
            if first + count > len(wanted):
                raise KVTransferError(FailureReason.PROTOCOL, f"chunk {index} runs past the requested blocks")
            try:
                self._scatterer.write(frames[3].buffer, dst[first : first + count])
            except ValueError as exc:
                raise KVTransferError(FailureReason.PROTOCOL, f"chunk {index}: {exc}") from None
            written += count
            if on_chunk is not None:
                on_chunk(index)
        if written != len(wanted):
            raise KVTransferError(FailureReason.PROTOCOL, f"received {written} of {len(wanted)} blocks")
        self._scatterer.finish()
