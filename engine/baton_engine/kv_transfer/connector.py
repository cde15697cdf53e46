"""Joins the engine core's step loop to KV transfer, in both roles.

Producer (``kv_role`` producer/both): a request whose ``kv_transfer_params`` is
``{"do_remote_decode": true}`` runs its prefill with ``max_tokens`` forced to 1 and keeps its
blocks when it finishes; `producer_finished` leases them to the serving thread and returns the
signed params for the response. Leases that end (DONE, RELEASE, expiry) are freed in the
scheduler at the start of the next step (`before_step`).

Consumer (``kv_role`` consumer/both): a request carrying signed params waits in
WAITING_FOR_REMOTE_KV; once the scheduler reserved its blocks (minus its own prefix hit) the
background puller fills them; the request then continues decoding after the producer's first
token, or recomputes its prefill locally (policy ``recompute``) or fails (policy ``fail``).

Tensor parallelism (`ranks`): every rank moves its own heads. A producer pod's ranks serve
their heads on their own ports (the params carry the layout: ``tp_size``, ``rank_ports``,
``num_kv_heads``); each rank holds the lease, and the blocks are freed once it ended on every
rank. A consumer pod's ranks each pull the heads they need from the producer ranks holding
them, in parallel (`kv_transfer.rank_agent`); once every rank has pulled, rank 0 ends the
lease on every producer rank and the request continues; if one rank failed, all of it is
recomputed (or failed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from baton_engine import contract
from baton_engine.config import EngineConfig
from baton_engine.contract import KVTransferParams
from baton_engine.core.request import Request, RequestStatus
from baton_engine.core.scheduler import Scheduler
from baton_engine.kv_transfer.cache_blocks import cache_spec
from baton_engine.kv_transfer.consumer import RankLayout
from baton_engine.kv_transfer.leases import LeaseEnd
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.params import require_key, sign_params, verify_params
from baton_engine.kv_transfer.producer import KVTransferProducer
from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError
from baton_engine.kv_transfer.puller import BackgroundPuller, PullJob

log = logging.getLogger(__name__)


class KVTransferRequestError(ValueError):
    """A request's kv_transfer_params cannot be served by this engine (an HTTP 400)."""


def is_remote_decode_request(raw: Any) -> bool:
    """A producer-leg request: ``{"do_remote_decode": true}`` (nothing else needed)."""
    return isinstance(raw, dict) and raw.get("do_remote_decode") is True


class RankLink(Protocol):
    """Rank 0's way to ranks 1..N-1 (`worker.tp_executor.TensorParallelExecutor`)."""

    size: int

    @property
    def kv_ports(self) -> list[int]:
        """The KV-transfer ports ranks 1..N-1 serve on (producers)."""
        ...

    def send_kv(self, rank: int, payload: Any) -> None: ...

    def check(self) -> None:
        """Raise if a rank failed (the group cannot go on)."""


@dataclass
class _PullParts:
    """A tensor-parallel consumer's pull of one request: one part per rank."""

    params: KVTransferParams
    pending: set[int]
    error: KVTransferError | None = None


@dataclass
class _RankLease:
    """A tensor-parallel producer's lease: the ranks still holding it, and how it ended on rank 0."""

    ranks: set[int]
    local_end: LeaseEnd | None = None


@dataclass
class _RankResults:
    """Results the ranks sent (on the executor's watchdog thread), until the step loop takes them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    items: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def put(self, rank: int, payload: dict[str, Any]) -> None:
        with self.lock:
            self.items.append((rank, payload))

    def take(self) -> list[tuple[int, dict[str, Any]]]:
        with self.lock:
            items, self.items = self.items, []
            return items


class KVTransferConnector:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: torch.Tensor,
        scheduler: Scheduler,
        *,
        model_name: str,
        port: int | None = None,
        environ: dict[str, str] | None = None,
        pull_timeout_s: float = 10.0,
        num_kv_heads: int | None = None,
        ranks: RankLink | None = None,
    ) -> None:
        """`num_kv_heads`: the model's KV heads in all (default: the cache's, one rank);
        `ranks`: with tensor parallelism, the link to ranks 1..N-1 (their results must be
        passed to `on_rank_result`)."""
        env = dict(os.environ) if environ is None else environ
        self.role = config.kv_role
        self.key = require_key(env)
        self.scheduler = scheduler
        self.model_name = model_name
        self.lease_seconds = config.kv_lease_seconds
        self.recompute_on_failure = config.kv_transfer_on_failure == "recompute"
        self.stats = TransferStats()
        self.spec = cache_spec(kv_cache)
        self.num_kv_heads = self.spec.num_kv_heads if num_kv_heads is None else num_kv_heads
        self.ranks = ranks
        self.tp_size = 1 if ranks is None else ranks.size
        self._rank_results = _RankResults()
        self._rank_leases: dict[str, _RankLease] = {}
        self._pull_parts: dict[int, _PullParts] = {}
        self.engine_id = uuid.uuid4().hex
        self.kv_key = config.kv_compat_key
        self.advertise_host = env.get(contract.ENV_POD_IP) or config.host
        self.producer: KVTransferProducer | None = None
        self.puller: BackgroundPuller | None = None
        if self.role in ("producer", "both"):
            self.producer = KVTransferProducer(
                kv_cache,
                engine_id=self.engine_id,
                bind_host=config.host,
                port=config.kv_transfer_port if port is None else port,
                stats=self.stats,
                kv_key=self.kv_key,
            )
        if self.role in ("consumer", "both"):
            self.puller = BackgroundPuller(
                kv_cache,
                stats=self.stats,
                timeout_s=pull_timeout_s,
                kv_key=self.kv_key,
                layout=RankLayout(self.num_kv_heads, self.tp_size, 0),
            )
        self._lease_of_request: dict[str, str] = {}  # producer: request id -> transfer id, while leased
        self._request_of_lease: dict[str, str] = {}
        self._consumer_params: dict[int, KVTransferParams] = {}  # seq id -> params, until pulled
        self._pulling: set[int] = set()
        self._aborted_while_pulling: dict[int, str | None] = {}
        self._send_ranks({"op": "start", "engine_id": self.engine_id})

    def _send_ranks(self, command: dict[str, Any]) -> None:
        if self.ranks is not None:
            for rank in range(1, self.tp_size):
                self.ranks.send_kv(rank, command)

    def on_rank_result(self, rank: int, payload: Any) -> None:
        """A rank's KV-transfer result (any thread); the step loop acts on it in `before_step`."""
        self._rank_results.put(rank, payload)

    # -- requests ---------------------------------------------------------------------------
    def prepare(self, seq: Request, raw: Any) -> None:
        """Set a new sequence up for its P/D leg, before it reaches the scheduler.

        Raises KVTransferRequestError for params this engine cannot serve.
        """
        if is_remote_decode_request(raw):
            if self.producer is None:
                raise KVTransferRequestError(
                    f"kv_transfer_params: this engine's kv_role is {self.role!r}, not producer"
                )
            seq.sampling_params = dataclasses.replace(seq.sampling_params, max_tokens=1)
            seq.hold_blocks_for_transfer = uuid.uuid4().hex
            return
        if self.puller is None:
            raise KVTransferRequestError(
                f"kv_transfer_params: this engine's kv_role is {self.role!r}, not consumer"
            )
        params = verify_params(raw, self.key)  # KVTransferParamsError is a ValueError too
        if params.num_tokens != seq.num_prompt_tokens:
            raise KVTransferRequestError(
                f"kv_transfer_params.num_tokens: {params.num_tokens} != this request's "
                f"{seq.num_prompt_tokens} prompt tokens"
            )
        seq.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._consumer_params[seq.seq_id] = params

    def producer_finished(self, seq: Request, request_id: str) -> dict[str, Any] | None:
        """Lease a finished producer request's blocks; the signed params for its response.

        Until the lease ends, aborting `request_id` (`release_request`) releases it: the
        response carrying the params may never reach the client (it went away during the
        prefill step, or just after it), and then nobody will pull them."""
        transfer_id = seq.hold_blocks_for_transfer
        if self.producer is None or transfer_id is None:
            return None
        held = self.scheduler.held_blocks(transfer_id)
        if held is None or not seq.output_token_ids:  # aborted or rejected: nothing kept
            return None
        num_blocks = -(-seq.num_prompt_tokens // self.spec.block_size)
        block_ids = held[:num_blocks]
        expires_at = self.producer.add_lease(transfer_id, block_ids, self.lease_seconds)
        self._lease_of_request[request_id] = transfer_id
        self._request_of_lease[transfer_id] = request_id
        rank_ports: list[int] = []
        if self.ranks is not None:
            self._rank_leases[transfer_id] = _RankLease(set(range(1, self.tp_size)))
            self._send_ranks(
                {
                    "op": "lease",
                    "transfer_id": transfer_id,
                    "block_ids": block_ids,
                    "seconds": self.lease_seconds,
                }
            )
            rank_ports = [self.producer.port, *self.ranks.kv_ports]
        return sign_params(
            key=self.key,
            engine_id=self.engine_id,
            host=self.advertise_host,
            port=self.producer.port,
            transfer_id=transfer_id,
            block_ids=block_ids,
            num_tokens=seq.num_prompt_tokens,
            first_token=seq.output_token_ids[0],
            spec=self.spec,
            model=self.model_name,
            lease_expires_at=expires_at,
            kv_key=self.kv_key,
            tp_size=self.tp_size,
            rank_ports=rank_ports,
            num_kv_heads=self.num_kv_heads,
        )

    def release_request(self, request_id: str) -> bool:
        """Producer: end the lease of finished request `request_id` early (its client is gone).
        False if it holds none (never leased, already pulled, released or expired)."""
        transfer_id = self._lease_of_request.get(request_id)
        if transfer_id is None or self.producer is None:
            return False
        released = self.producer.release(transfer_id)
        if transfer_id in self._rank_leases:
            self._send_ranks({"op": "release", "transfer_id": transfer_id})
        if released:
            log.info("KV transfer: lease %s released early (request %s aborted)", transfer_id, request_id)
        return released

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        """Producer: end a lease early on request (signed params checked by the caller). False
        if the params are another engine's (e.g. before this one restarted) or not leased."""
        if self.producer is None or engine_id != self.engine_id:
            return False
        if transfer_id in self._rank_leases:
            self._send_ranks({"op": "release", "transfer_id": transfer_id})
        return self.producer.release(transfer_id)

    def abort(self, seq_id: int, message: str | None) -> bool:
        """Called before the scheduler aborts `seq_id`. True: the abort is deferred until the
        running pull stops writing into the sequence's blocks (`before_step` finishes it)."""
        params = self._consumer_params.pop(seq_id, None)
        if seq_id in self._pull_parts and self.puller is not None:
            # Some rank is still writing into the sequence's blocks: wait for every part.
            self.puller.cancel(seq_id)
            self._send_ranks({"op": "cancel", "seq_id": seq_id})
            self._aborted_while_pulling[seq_id] = message
            return True
        if seq_id in self._pulling and self.puller is not None and self.puller.cancel(seq_id):
            self._aborted_while_pulling[seq_id] = message
            return True
        if params is not None and self.puller is not None:
            self.puller.release(params)  # never pulled: let the producer free now
        return False

    # -- the step loop ----------------------------------------------------------------------
    def busy(self) -> bool:
        """Pulls are in flight (the step loop has nothing else of these requests to run)."""
        return bool(self._pulling)

    def before_step(self) -> bool:
        """Free ended leases and take finished pulls; True if a lease's blocks were freed."""
        freed = False
        if self.ranks is not None:
            self.ranks.check()  # pulls may be all that runs: a dead rank must not leave them waiting
        rank_results = self._rank_results.take()
        if self.producer is not None:
            for transfer_id, how in self.producer.take_ended():
                lease = self._rank_leases.get(transfer_id)
                if lease is not None and lease.ranks:
                    lease.local_end = how  # freed once every rank's lease ended too
                    continue
                self._rank_leases.pop(transfer_id, None)
                freed = self._free_lease(transfer_id, how) or freed
            for rank, result in rank_results:
                if result.get("op") != "ended":
                    continue
                transfer_id = str(result["transfer_id"])
                lease = self._rank_leases.get(transfer_id)
                if lease is None:
                    continue
                lease.ranks.discard(rank)
                if not lease.ranks and lease.local_end is not None:
                    del self._rank_leases[transfer_id]
                    freed = self._free_lease(transfer_id, lease.local_end) or freed
        if self.puller is None:
            return freed
        for job in self.puller.take_finished():
            if self.tp_size == 1:
                self._pull_finished(job.seq_id, job.params, job.error)
            else:
                self._part_finished(job.seq_id, 0, job.error)
        for rank, result in rank_results:
            if result.get("op") == "pulled":
                error = result.get("error")
                failure = None if error is None else KVTransferError(FailureReason(error[0]), str(error[1]))
                self._part_finished(int(result["seq_id"]), rank, failure)
        return freed

    def _free_lease(self, transfer_id: str, how: LeaseEnd) -> bool:
        request_id = self._request_of_lease.pop(transfer_id, None)
        if request_id is not None and self._lease_of_request.get(request_id) == transfer_id:
            del self._lease_of_request[request_id]
        if not self.scheduler.release(transfer_id):
            log.warning("KV transfer: lease %s ended (%s) with no held blocks", transfer_id, how)
        elif how is LeaseEnd.EXPIRED:
            log.info("KV transfer: lease %s expired; blocks freed", transfer_id)
        return True

    def _part_finished(self, seq_id: int, rank: int, error: KVTransferError | None) -> None:
        parts = self._pull_parts.get(seq_id)
        if parts is None:
            return
        parts.pending.discard(rank)
        if error is not None and parts.error is None:
            parts.error = error
        if parts.pending:
            return
        del self._pull_parts[seq_id]
        assert self.puller is not None
        if parts.error is None:
            self.puller.finish(parts.params)  # every rank has its heads: the producer may free
        else:
            self.puller.release(parts.params)
        self._pull_finished(seq_id, parts.params, parts.error)

    def _pull_finished(self, seq_id: int, params: KVTransferParams, error: KVTransferError | None) -> None:
        self._pulling.discard(seq_id)
        if seq_id in self._aborted_while_pulling:
            message = self._aborted_while_pulling.pop(seq_id)
            self.scheduler.abort(seq_id, message)
        elif error is None:
            self.scheduler.mark_remote_kv_arrived(seq_id, params.num_tokens, params.first_token)
        else:
            action = "recomputing locally" if self.recompute_on_failure else "failing the request"
            log.warning("KV transfer %s failed (%s); %s", params.transfer_id, error, action)
            seq = self.scheduler.get(seq_id)
            self.scheduler.mark_remote_kv_failed(seq_id, recompute=self.recompute_on_failure)
            if seq is not None and seq.is_finished:
                seq.finish_message = f"KV transfer from the prefill engine failed: {error}"

    def after_schedule(self) -> None:
        """Start the pulls of requests whose blocks the scheduler just reserved."""
        if self.puller is None:
            return
        for seq in self.scheduler.take_remote_kv_reservations():
            params = self._consumer_params.pop(seq.seq_id, None)
            if params is None:  # aborted meanwhile
                continue
            skip = seq.num_cached_tokens // self.spec.block_size
            num_blocks = len(params.block_ids)
            dst = list(seq.block_table[skip:num_blocks])
            self._pulling.add(seq.seq_id)
            if self.tp_size > 1:
                self._pull_parts[seq.seq_id] = _PullParts(params, set(range(self.tp_size)))
                self._send_ranks(
                    {
                        "op": "pull",
                        "seq_id": seq.seq_id,
                        "params": params.to_dict(),
                        "dst_block_ids": dst,
                        "skip_blocks": skip,
                    }
                )
            self.puller.submit(
                PullJob(
                    seq_id=seq.seq_id,
                    params=params,
                    dst_block_ids=dst,
                    skip_blocks=skip,
                    end_lease=self.tp_size == 1,
                )
            )

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.puller is not None:
            self.puller.close()
