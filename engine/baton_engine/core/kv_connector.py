"""The seam between the torch-free core and P/D KV transfer: the `KVConnector` Protocol.

The core calls the connector; the connector never calls the core. What happens on the
connector's own threads (pulls, lease expiry) comes back as data, `KVConnectorUpdates`, which
the scheduler applies at the start of its next step. `kv_transfer.connector.KVTransferConnector`
implements it over ZeroMQ; the tests' scripted connector implements it in memory.

Lifecycle of a P/D request on each side:

* producer (``{"do_remote_decode": true}``): `prepare` caps it to one output token and marks it
  for holding; it runs like any request; when it finishes, `request_finished` leases its blocks
  and returns the signed params for the response; the scheduler keeps the blocks until
  `KVConnectorUpdates.leases_ended` names the request (pulled, released or expired).
* consumer (signed params): `prepare` validates them and sets the request WAITING_FOR_REMOTE_KV;
  once the scheduler has reserved its blocks it calls `blocks_reserved` and the connector pulls;
  `KVConnectorUpdates.arrived` / `failed` say how the pull ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from baton_engine.core.request import Request


@dataclass(frozen=True)
class RemoteKVArrived:
    """A consumer's pull finished: the producer's KV is in the request's reserved blocks."""

    req_id: int
    num_computed_tokens: int
    """Prompt tokens whose KV the blocks now hold (the whole prompt, as the producer computed it)."""
    first_token_id: int | None
    """The token the producer sampled after the prompt; None to sample it here."""


@dataclass(frozen=True)
class RemoteKVFailed:
    """A consumer's pull failed (producer unreachable, lease expired, a spec mismatch...)."""

    req_id: int
    message: str
    """Why, for the request's `finish_message` when it fails (``--kv-transfer-on-failure fail``)."""
    recompute: bool
    """Recompute the prompt locally (policy ``recompute``) instead of failing the request."""


@dataclass
class KVConnectorUpdates:
    """What the connector's threads did since the previous `KVConnector.take_updates`."""

    arrived: list[RemoteKVArrived] = field(default_factory=list)
    """Consumer pulls that finished, in the order they finished."""
    failed: list[RemoteKVFailed] = field(default_factory=list)
    """Consumer pulls that failed."""
    pulls_stopped: list[int] = field(default_factory=list)
    """Consumer requests aborted while their pull ran (`abort_pull` returned True): the pull no
    longer writes their blocks, which may be freed now."""
    leases_ended: list[int] = field(default_factory=list)
    """Producer requests whose leased blocks are no longer needed (pulled, released, expired)."""

    def __bool__(self) -> bool:
        return bool(self.arrived or self.failed or self.pulls_stopped or self.leases_ended)


class KVConnector(Protocol):
    """P/D hooks the engine core calls. Scheduler-side hooks first, then the engine core's."""

    # -- called by the scheduler ------------------------------------------------------------
    def blocks_reserved(self, request: Request, block_ids: Sequence[int]) -> None:
        """Consumer: `block_ids` (the request's whole block table) are reserved for its prompt;
        the first ``request.num_cached_tokens // block_size`` already hold a local prefix hit.
        Start pulling the rest."""
        ...

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> dict[str, Any] | None:
        """Any request finished (its `finish_reason` is set), holding `block_ids`. A producer
        request that stopped or hit its length: lease the prompt's blocks and return the signed
        kv_transfer_params for its response (the scheduler keeps the blocks until `leases_ended`
        names it). Otherwise None (the blocks are freed now), after forgetting the request (a
        consumer's params that were never pulled are released to their producer)."""
        ...

    def abort_pull(self, request: Request) -> bool:
        """The scheduler aborts consumer `request`, whose blocks were reserved (`blocks_reserved`).
        True: its pull still runs and writes its blocks; the scheduler frees them once
        `pulls_stopped` names it. False: the pull already ended (its end is in the next updates,
        which the scheduler then ignores)."""
        ...

    def take_updates(self) -> KVConnectorUpdates:
        """What ended since the last call (the scheduler applies it before each step)."""
        ...

    # -- called by the engine core ----------------------------------------------------------
    def prepare(self, request: Request, raw_params: Any) -> None:
        """Set a new request up for its P/D leg before it is queued (producer: one output token;
        consumer: WAITING_FOR_REMOTE_KV). Raises ValueError naming the field for params this
        engine cannot serve."""
        ...

    def release_request(self, client_id: str) -> bool:
        """Producer: end the lease of finished request `client_id` early (its client went away,
        so nobody will pull). False if it holds none."""
        ...

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        """Producer: end a lease early on a peer's request (the router's release). False if the
        params are another engine's or not leased."""
        ...

    def busy(self) -> bool:
        """Pulls are in flight (an idle step loop should yield to their threads)."""
        ...

    @property
    def num_leases_held(self) -> int:
        """Producer leases not yet ended: prefilled KV a consumer may still pull."""
        ...

    @property
    def stats_version(self) -> int:
        """Changes whenever the transfer totals change (worth a stats push)."""
        ...

    def stats_totals(self) -> dict[str, Any]:
        """Cumulative transfer totals (bytes, seconds, failures by reason, leases expired)."""
        ...

    def close(self) -> None: ...
