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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from typing import Any

import torch

from baton_engine import contract
from baton_engine.config import EngineConfig
from baton_engine.contract import KVTransferParams
from baton_engine.core.request import Request, RequestStatus
from baton_engine.core.scheduler import Scheduler
from baton_engine.kv_transfer.cache_blocks import cache_spec
from baton_engine.kv_transfer.leases import LeaseEnd
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.params import require_key, sign_params, verify_params
from baton_engine.kv_transfer.producer import KVTransferProducer
from baton_engine.kv_transfer.puller import BackgroundPuller, PullJob

log = logging.getLogger(__name__)


class KVTransferRequestError(ValueError):
    """A request's kv_transfer_params cannot be served by this engine (an HTTP 400)."""


def is_remote_decode_request(raw: Any) -> bool:
    """A producer-leg request: ``{"do_remote_decode": true}`` (nothing else needed)."""
    return isinstance(raw, dict) and raw.get("do_remote_decode") is True


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
    ) -> None:
        env = dict(os.environ) if environ is None else environ
        self.role = config.kv_role
        self.key = require_key(env)
        self.scheduler = scheduler
        self.model_name = model_name
        self.lease_seconds = config.kv_lease_seconds
        self.recompute_on_failure = config.kv_transfer_on_failure == "recompute"
        self.stats = TransferStats()
        self.spec = cache_spec(kv_cache)
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
                kv_cache, stats=self.stats, timeout_s=pull_timeout_s, kv_key=self.kv_key
            )
        self._lease_of_request: dict[str, str] = {}  # producer: request id -> transfer id, while leased
        self._request_of_lease: dict[str, str] = {}
        self._consumer_params: dict[int, KVTransferParams] = {}  # seq id -> params, until pulled
        self._pulling: set[int] = set()
        self._aborted_while_pulling: dict[int, str | None] = {}

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
        )

    def release_request(self, request_id: str) -> bool:
        """Producer: end the lease of finished request `request_id` early (its client is gone).
        False if it holds none (never leased, already pulled, released or expired)."""
        transfer_id = self._lease_of_request.get(request_id)
        if transfer_id is None or self.producer is None:
            return False
        released = self.producer.release(transfer_id)
        if released:
            log.info("KV transfer: lease %s released early (request %s aborted)", transfer_id, request_id)
        return released

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        """Producer: end a lease early on request (signed params checked by the caller). False
        if the params are another engine's (e.g. before this one restarted) or not leased."""
        if self.producer is None or engine_id != self.engine_id:
            return False
        return self.producer.release(transfer_id)

    def abort(self, seq_id: int, message: str | None) -> bool:
        """Called before the scheduler aborts `seq_id`. True: the abort is deferred until the
        running pull stops writing into the sequence's blocks (`before_step` finishes it)."""
        params = self._consumer_params.pop(seq_id, None)
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
        if self.producer is not None:
            for transfer_id, how in self.producer.take_ended():
                freed = True
                request_id = self._request_of_lease.pop(transfer_id, None)
                if request_id is not None and self._lease_of_request.get(request_id) == transfer_id:
                    del self._lease_of_request[request_id]
                if not self.scheduler.release(transfer_id):
                    log.warning("KV transfer: lease %s ended (%s) with no held blocks", transfer_id, how)
                elif how is LeaseEnd.EXPIRED:
                    log.info("KV transfer: lease %s expired; blocks freed", transfer_id)
        if self.puller is None:
            return freed
        for job in self.puller.take_finished():
            self._pulling.discard(job.seq_id)
            if job.seq_id in self._aborted_while_pulling:
                message = self._aborted_while_pulling.pop(job.seq_id)
                self.scheduler.abort(job.seq_id, message)
            elif job.error is None:
                self.scheduler.mark_remote_kv_arrived(
                    job.seq_id, job.params.num_tokens, job.params.first_token
                )
            else:
                action = "recomputing locally" if self.recompute_on_failure else "failing the request"
                log.warning("KV transfer %s failed (%s); %s", job.params.transfer_id, job.error, action)
                seq = self.scheduler.get(job.seq_id)
                self.scheduler.mark_remote_kv_failed(job.seq_id, recompute=self.recompute_on_failure)
                if seq is not None and seq.is_finished:
                    seq.finish_message = f"KV transfer from the prefill engine failed: {job.error}"
        return freed

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
            self._pulling.add(seq.seq_id)
            self.puller.submit(
                PullJob(
                    seq_id=seq.seq_id,
                    params=params,
                    dst_block_ids=list(seq.block_table[skip:num_blocks]),
                    skip_blocks=skip,
                )
            )

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.puller is not None:
            self.puller.close()
