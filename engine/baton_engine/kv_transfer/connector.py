"""`KVTransferConnector`: the engine's P/D KV transfer, behind the core's `KVConnector` Protocol.

Producer (``kv_role`` producer/both): a request whose ``kv_transfer_params`` is
``{"do_remote_decode": true}`` runs its prefill with ``max_tokens`` forced to 1; when it
finishes, `request_finished` leases its prompt's blocks in the producer's lease table (the only
one: `leases.LeaseTable`) and returns the signed params for the response. Leases that end (DONE,
RELEASE, expiry) come back to the scheduler as `KVConnectorUpdates.leases_ended`.

Consumer (``kv_role`` consumer/both): a request carrying signed params waits in
WAITING_FOR_REMOTE_KV; once the scheduler reserved its blocks (minus its own prefix hit,
`blocks_reserved`) the background puller fills them; the outcome comes back as
`KVConnectorUpdates.arrived` (the request continues decoding after the producer's first token)
or `failed` (recompute the prefill locally, policy ``recompute``, or fail, policy ``fail``).

The connector never calls the scheduler: the scheduler calls it and applies its updates.

Tensor parallelism (`ranks`): every rank moves its own heads. A producer pod's ranks serve
their heads on their own ports (the params carry the layout: ``tp_size``, ``rank_ports``,
``num_kv_heads``); each rank holds the lease, and it ends (``leases_ended``) once it ended on
every rank. A consumer pod's ranks each pull the heads they need from the producer ranks
holding them, in parallel (`kv_transfer.rank_agent`); once every rank has pulled, rank 0 ends
the lease on every producer rank and the request continues; if one rank failed, all of it is
recomputed (or failed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from baton_engine import contract
from baton_engine.config import EngineConfig
from baton_engine.contract import KVTransferParams
from baton_engine.core.kv_connector import KVConnectorUpdates, RemoteKVArrived, RemoteKVFailed
from baton_engine.core.request import FinishReason, Request, RequestStatus
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
    """Results the ranks sent (on the executor's watchdog thread), until `take_updates` takes them."""

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
    """Implements `baton_engine.core.kv_connector.KVConnector`."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: torch.Tensor,
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
        self._transfer_of: dict[int, str] = {}  # producer: req id -> transfer id, until it finished
        self._leases: dict[str, tuple[int, str]] = {}  # transfer id -> (req id, client id), while leased
        self._lease_of_client: dict[str, str] = {}  # client id -> transfer id, while leased
        self._consumer_params: dict[int, KVTransferParams] = {}  # req id -> params, until pulled
        self._pulling: set[int] = set()
        self._cancelled: set[int] = set()  # aborted while their pull ran
        self._send_ranks({"op": "start", "engine_id": self.engine_id})

    def _send_ranks(self, command: dict[str, Any]) -> None:
        if self.ranks is not None:
            for rank in range(1, self.tp_size):
                self.ranks.send_kv(rank, command)

    def on_rank_result(self, rank: int, payload: Any) -> None:
        """A rank's KV-transfer result (any thread); `take_updates` acts on it."""
        self._rank_results.put(rank, payload)

    # -- the engine core's hooks -------------------------------------------------------------
    def prepare(self, request: Request, raw_params: Any) -> None:
        """Set a new request up for its P/D leg, before it reaches the scheduler.

        Raises KVTransferRequestError for params this engine cannot serve.
        """
        if is_remote_decode_request(raw_params):
            if self.producer is None:
                raise KVTransferRequestError(
                    f"kv_transfer_params: this engine's kv_role is {self.role!r}, not producer"
                )
            request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=1)
            self._transfer_of[request.req_id] = uuid.uuid4().hex
            return
        if self.puller is None:
            raise KVTransferRequestError(
                f"kv_transfer_params: this engine's kv_role is {self.role!r}, not consumer"
            )
        params = verify_params(raw_params, self.key)  # KVTransferParamsError is a ValueError too
        if params.num_tokens != request.num_prompt_tokens:
            raise KVTransferRequestError(
                f"kv_transfer_params.num_tokens: {params.num_tokens} != this request's "
                f"{request.num_prompt_tokens} prompt tokens"
            )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._consumer_params[request.req_id] = params

    def release_request(self, client_id: str) -> bool:
        """Producer: end the lease of finished request `client_id` early (its client is gone).
        False if it holds none (never leased, already pulled, released or expired)."""
        transfer_id = self._lease_of_client.get(client_id)
        if transfer_id is None or self.producer is None:
            return False
        released = self.producer.release(transfer_id)
        if transfer_id in self._rank_leases:
            self._send_ranks({"op": "release", "transfer_id": transfer_id})
        if released:
            log.info("KV transfer: lease %s released early (request %s aborted)", transfer_id, client_id)
        return released

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        """Producer: end a lease early on request (signed params checked by the caller). False
        if the params are another engine's (e.g. before this one restarted) or not leased."""
        if self.producer is None or engine_id != self.engine_id:
            return False
        if transfer_id in self._rank_leases:
            self._send_ranks({"op": "release", "transfer_id": transfer_id})
        return self.producer.release(transfer_id)

    def busy(self) -> bool:
        """Pulls are in flight (the step loop has nothing else of these requests to run)."""
        return bool(self._pulling)

    @property
    def num_leases_held(self) -> int:
        return 0 if self.producer is None else len(self.producer.leases)

    @property
    def stats_version(self) -> int:
        return self.stats.version

    def stats_totals(self) -> dict[str, Any]:
        return self.stats.totals().to_dict()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.puller is not None:
            self.puller.close()

    # -- the scheduler's hooks ---------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> dict[str, Any] | None:
        """Lease a finished producer request's prompt blocks; the signed params for its response
        (None for any other request, which the connector then forgets).

        Until the lease ends, aborting the request (`release_request`) releases it: the
        response carrying the params may never reach the client (it went away during the
        prefill step, or just after it), and then nobody will pull them."""
        transfer_id = self._transfer_of.pop(request.req_id, None)
        unpulled = self._consumer_params.pop(request.req_id, None)
        if unpulled is not None and self.puller is not None:
            self.puller.release(unpulled)  # finished before its pull (rejected): free the producer
        leasable = (
            request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and request.output_token_ids
        )
        if self.producer is None or transfer_id is None or not leasable:
            return None
        num_blocks = -(-request.num_prompt_tokens // self.spec.block_size)
        leased = list(block_ids[:num_blocks])
        expires_at = self.producer.add_lease(transfer_id, leased, self.lease_seconds)
        self._leases[transfer_id] = (request.req_id, request.client_id)
        self._lease_of_client[request.client_id] = transfer_id
        rank_ports: list[int] = []
        if self.ranks is not None:
            self._rank_leases[transfer_id] = _RankLease(set(range(1, self.tp_size)))
            self._send_ranks(
                {
                    "op": "lease",
                    "transfer_id": transfer_id,
                    "block_ids": leased,
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
            block_ids=leased,
            num_tokens=request.num_prompt_tokens,
            first_token=request.output_token_ids[0],
            spec=self.spec,
            model=self.model_name,
            lease_expires_at=expires_at,
            kv_key=self.kv_key,
            tp_size=self.tp_size,
            rank_ports=rank_ports,
            num_kv_heads=self.num_kv_heads,
        )

    def blocks_reserved(self, request: Request, block_ids: Sequence[int]) -> None:
        """Start pulling the prompt's KV into `block_ids`, past the local prefix hit."""
        params = self._consumer_params.pop(request.req_id, None)
        if params is None or self.puller is None:
            raise KeyError(f"request {request.req_id} has no kv_transfer_params to pull")
        skip = request.num_cached_tokens // self.spec.block_size
        dst = list(block_ids[skip : len(params.block_ids)])
        self._pulling.add(request.req_id)
        if self.tp_size > 1:
            self._pull_parts[request.req_id] = _PullParts(params, set(range(self.tp_size)))
            self._send_ranks(
                {
                    "op": "pull",
                    "req_id": request.req_id,
                    "params": params.to_dict(),
                    "dst_block_ids": dst,
                    "skip_blocks": skip,
                }
            )
        self.puller.submit(
            PullJob(
                req_id=request.req_id,
                params=params,
                dst_block_ids=dst,
                skip_blocks=skip,
                end_lease=self.tp_size == 1,
            )
        )

    def abort_pull(self, request: Request) -> bool:
        """True: the request's pull is running and stops soon (reported in `pulls_stopped`)."""
        if request.req_id in self._pull_parts and self.puller is not None:
            # Some rank may still write into the request's blocks: wait for every part.
            self.puller.cancel(request.req_id)
            self._send_ranks({"op": "cancel", "req_id": request.req_id})
            self._cancelled.add(request.req_id)
            return True
        if request.req_id in self._pulling and self.puller is not None and self.puller.cancel(request.req_id):
            self._cancelled.add(request.req_id)
            return True
        return False

    def take_updates(self) -> KVConnectorUpdates:
        """Ended leases and finished pulls since the last call."""
        updates = KVConnectorUpdates()
        if self.ranks is not None:
            self.ranks.check()  # pulls may be all that runs: a dead rank must not leave them waiting
        rank_results = self._rank_results.take()
        if self.producer is not None:
            for transfer_id, how in self.producer.take_ended():
                rank_lease = self._rank_leases.get(transfer_id)
                if rank_lease is not None and rank_lease.ranks:
                    rank_lease.local_end = how  # ends once every rank's lease ended too
                    continue
                self._rank_leases.pop(transfer_id, None)
                self._lease_ended(transfer_id, how, updates)
            for rank, result in rank_results:
                if result.get("op") != "ended":
                    continue
                transfer_id = str(result["transfer_id"])
                rank_lease = self._rank_leases.get(transfer_id)
                if rank_lease is None:
                    continue
                rank_lease.ranks.discard(rank)
                if not rank_lease.ranks and rank_lease.local_end is not None:
                    del self._rank_leases[transfer_id]
                    self._lease_ended(transfer_id, rank_lease.local_end, updates)
        if self.puller is None:
            return updates
        for job in self.puller.take_finished():
            if self.tp_size == 1:
                self._pull_finished(job.req_id, job.params, job.error, updates)
            else:
                self._part_finished(job.req_id, 0, job.error, updates)
        for rank, result in rank_results:
            if result.get("op") == "pulled":
                error = result.get("error")
                failure = None if error is None else KVTransferError(FailureReason(error[0]), str(error[1]))
                self._part_finished(int(result["req_id"]), rank, failure, updates)
        return updates

    def _lease_ended(self, transfer_id: str, how: LeaseEnd, updates: KVConnectorUpdates) -> None:
        lease = self._leases.pop(transfer_id, None)
        if lease is None:
            log.warning("KV transfer: lease %s ended (%s) with no request", transfer_id, how)
            return
        req_id, client_id = lease
        if self._lease_of_client.get(client_id) == transfer_id:
            del self._lease_of_client[client_id]
        updates.leases_ended.append(req_id)
        if how is LeaseEnd.EXPIRED:
            log.info("KV transfer: lease %s expired; blocks freed", transfer_id)

    def _part_finished(
        self, req_id: int, rank: int, error: KVTransferError | None, updates: KVConnectorUpdates
    ) -> None:
        parts = self._pull_parts.get(req_id)
        if parts is None:
            return
        parts.pending.discard(rank)
        if error is not None and parts.error is None:
            parts.error = error
        if parts.pending:
            return
        del self._pull_parts[req_id]
        assert self.puller is not None
        if parts.error is None:
            self.puller.finish(parts.params)  # every rank has its heads: the producer may free
        else:
            self.puller.release(parts.params)
        self._pull_finished(req_id, parts.params, parts.error, updates)

    def _pull_finished(
        self,
        req_id: int,
        params: KVTransferParams,
        error: KVTransferError | None,
        updates: KVConnectorUpdates,
    ) -> None:
        self._pulling.discard(req_id)
        if req_id in self._cancelled:
            self._cancelled.discard(req_id)
            updates.pulls_stopped.append(req_id)
        elif error is None:
            updates.arrived.append(RemoteKVArrived(req_id, params.num_tokens, params.first_token))
        else:
            action = "recomputing locally" if self.recompute_on_failure else "failing the request"
            log.warning("KV transfer %s failed (%s); %s", params.transfer_id, error, action)
            updates.failed.append(
                RemoteKVFailed(
                    req_id,
                    f"KV transfer from the prefill engine failed: {error}",
                    recompute=self.recompute_on_failure,
                )
            )
