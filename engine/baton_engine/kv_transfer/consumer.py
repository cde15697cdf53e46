"""Consumer (decode) side: pulls a producer's leased blocks into this engine's own blocks.

One `KVTransferConsumer` is used by one thread. Each pull opens its own DEALER to the producer
(so no late reply of an abandoned pull can be mistaken for a new one) and watches it with a
socket monitor: a refused connection or a connection lost mid-transfer fails the pull at once;
every other wait has a deadline.

The caller must have verified the signed params (`params.verify_params`) before calling `pull`.
"""

from __future__ import annotations

import dataclasses
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
from baton_engine.kv_transfer.head_layout import HeadSource, head_sources
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


def endpoint(params: KVTransferParams, producer_rank: int = 0) -> str:
    """The address of the producer's rank `producer_rank` (rank 0: ``params.port``)."""
    host = f"[{params.host}]" if ":" in params.host else params.host
    port = params.rank_ports[producer_rank] if params.rank_ports else params.port
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class RankLayout:
    """This consumer's place among its pod's ranks: rank `rank` of `tp_size`, of a model with
    `num_kv_heads` KV heads in all."""

    num_kv_heads: int
    tp_size: int = 1
    rank: int = 0


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
        layout: RankLayout | None = None,
    ) -> None:
        """`kv_key`: this engine's KV-compatibility key; params carrying another are refused.
        `layout`: this rank's place in a tensor-parallel pod (default: one rank, every head)."""
        self.kv_key = kv_key
        self._scatterer = BlockScatterer(kv_cache)
        self.spec = self._scatterer.spec
        self.layout = layout if layout is not None else RankLayout(self.spec.num_kv_heads)
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
        if params.num_kv_heads and params.num_kv_heads != self.layout.num_kv_heads:
            raise KVTransferError(
                FailureReason.SPEC_MISMATCH,
                f"kv_transfer_params.num_kv_heads: the producer's model has {params.num_kv_heads} KV heads, "
                f"this engine's {self.layout.num_kv_heads}; refusing to pull",
            )

    def sources(self, params: KVTransferParams) -> list[HeadSource]:
        """What this rank pulls from which producer rank (the params' layout checked)."""
        layout = self.layout
        if params.tp_size == 1 and layout.tp_size == 1:
            return [HeadSource(0, 0, 0, self.spec.num_kv_heads)]
        return head_sources(layout.num_kv_heads, params.tp_size, layout.tp_size, layout.rank)

    def pull(
        self,
        params: KVTransferParams,
        dst_block_ids: list[int],
        *,
        skip_blocks: int = 0,
        on_chunk: Callable[[int], None] | None = None,
        end_lease: bool = True,
    ) -> PullResult:
        """Pull the producer's blocks ``params.block_ids[skip_blocks:]`` into `dst_block_ids`:
        this rank's heads, from the producer ranks holding them (`sources`).

        `skip_blocks` is this engine's own prefix-cache hit, in blocks. With `end_lease`, on
        success the producer (every rank) has released its lease; on failure a RELEASE is sent
        where it may still hold it. Without it (a rank of a tensor-parallel consumer, whose
        rank 0 ends the lease once every rank pulled: `finish`) the lease is left alone.
        Raises KVTransferError (and records its reason); `on_chunk(index)` runs after each
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
            if exc.reason is FailureReason.KV_KEY_MISMATCH and end_lease:
                # Signed by this deployment but never to be pulled here: let the producer free
                # the blocks now rather than at lease expiry.
                self.release(params)
            raise
        channels: dict[int, _Channel] = {}
        linger = 0
        try:
            sources = self.sources(params)
            whole = params.tp_size == 1 and self.layout.tp_size == 1  # every head, one pull: no slice
            for source in sources:
                if wanted:
                    channel = self._channel(channels, params, source.producer_rank)
                    heads = None if whole else source
                    self._transfer(channel, uuid.uuid4().hex, params, wanted, dst_block_ids, on_chunk, heads)
            if end_lease:
                for rank in range(params.tp_size):
                    pull_id = uuid.uuid4().hex
                    channel = self._channel(channels, params, rank)
                    channel.send(Kind.DONE, self._ids(params, pull_id))
                    channel.recv(pull_id)  # ACK
        except KVTransferError as exc:
            self.stats.failed(exc.reason.value)
            if end_lease and exc.reason not in _NOTHING_HELD:
                # Every producer rank holds the lease, also those this pull had not reached yet
                # (the sources are pulled one after the other).
                for rank in range(params.tp_size):
                    self._channel(channels, params, rank).send(
                        Kind.RELEASE, self._ids(params, uuid.uuid4().hex)
                    )
                linger = _RELEASE_LINGER_MS
            raise
        finally:
            for channel in channels.values():
                channel.close(linger)
        seconds = time.perf_counter() - started
        nbytes = sum(len(wanted) * self._slice_spec(source).block_bytes for source in sources)
        self.stats.received(nbytes, seconds)
        return PullResult(num_blocks=len(wanted), num_bytes=nbytes, seconds=seconds)

    def _channel(self, channels: dict[int, _Channel], params: KVTransferParams, rank: int) -> _Channel:
        """The open channel to producer rank `rank` of this pull (opened on first use)."""
        channel = channels.get(rank)
        if channel is None:
            channel = channels[rank] = _Channel(self._ctx, endpoint(params, rank), self.timeout_s)
        return channel

    def release(self, params: KVTransferParams) -> bool:
        """Tell the producer (every rank) to drop a lease this engine will not pull (request
        aborted). True if every rank acknowledged it."""
        return self._end(params, Kind.RELEASE)

    def finish(self, params: KVTransferParams) -> bool:
        """Tell the producer (every rank) that every rank of this pod pulled its heads (DONE).
        True if every rank acknowledged it."""
        return self._end(params, Kind.DONE)

    def _end(self, params: KVTransferParams, kind: Kind) -> bool:
        acknowledged = True
        for rank in range(params.tp_size):
            channel = _Channel(self._ctx, endpoint(params, rank), self.timeout_s)
            pull_id = uuid.uuid4().hex
            try:
                channel.send(kind, self._ids(params, pull_id))
                channel.recv(pull_id)
            except KVTransferError:
                acknowledged = False
            finally:
                channel.close()
        return acknowledged

    def _slice_spec(self, source: HeadSource | None) -> protocol.CacheSpec:
        if source is None or source.count == self.spec.num_kv_heads:
            return self.spec
        return dataclasses.replace(self.spec, num_kv_heads=source.count)

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
        source: HeadSource | None,
    ) -> None:
        """One PULL: every head (`source` None), or the heads `source` names."""
        spec = self._slice_spec(source)
        request: dict[str, Any] = {
            **self._ids(params, pull_id),
            "block_ids": wanted,
            "spec": spec.to_dict(),
            "kv_key": self.kv_key,
        }
        dst_heads = None
        if source is not None:
            request["heads"] = [source.src_head, source.count]
            dst_heads = (source.dst_head, source.count)
        channel.send(Kind.PULL, request)
        kind, meta, _ = channel.recv(pull_id)
        if kind is not Kind.META:
            raise KVTransferError(FailureReason.PROTOCOL, f"expected META, got {kind.name}")
        try:
            theirs = protocol.CacheSpec.from_dict(meta.get("spec"))
        except ValueError as exc:
            raise KVTransferError(FailureReason.PROTOCOL, f"META: {exc}") from None
        diff = spec.mismatch(theirs)
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
                self._scatterer.write(frames[3].buffer, dst[first : first + count], dst_heads)
            except ValueError as exc:
                raise KVTransferError(FailureReason.PROTOCOL, f"chunk {index}: {exc}") from None
            written += count
            if on_chunk is not None:
                on_chunk(index)
        if written != len(wanted):
            raise KVTransferError(FailureReason.PROTOCOL, f"received {written} of {len(wanted)} blocks")
        self._scatterer.finish()
