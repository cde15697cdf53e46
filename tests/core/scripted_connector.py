"""A `KVConnector` the test scripts: the scheduler's P/D hooks, deterministic and in memory.

It records what the scheduler asked of it (blocks reserved for a pull, finished requests, pulls
aborted) and hands back exactly the updates the test queued (`arrive`, `fail`, `stop_pull`,
`end_lease`), so a test decides when a pull ends and how. The real connector
(`kv_transfer.connector`, ZeroMQ, real KV) is tested against this same Protocol in
tests/kv_transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baton_engine.core.kv_connector import KVConnectorUpdates, RemoteKVArrived, RemoteKVFailed
from baton_engine.core.request import FinishReason, Request


class ScriptedConnector:
    def __init__(self, block_size: int, *, producer_ids: Sequence[int] = ()) -> None:
        self.block_size = block_size
        self.producer_ids = set(producer_ids)
        """Requests to lease when they finish (the producer's ``do_remote_decode`` ones)."""
        self.reserved: dict[int, list[int]] = {}
        """Request id -> the block table the scheduler reserved for its pull, in reservation order."""
        self.pulling: set[int] = set()
        self.leased: dict[int, list[int]] = {}
        """Producer request id -> the prompt blocks leased when it finished."""
        self.finished: list[tuple[int, FinishReason | None]] = []
        """Every request the scheduler reported finished, with its reason."""
        self.aborted_pulls: list[int] = []
        self._updates = KVConnectorUpdates()

    # -- the test's side --------------------------------------------------------------------
    def arrive(self, req_id: int, num_tokens: int, first_token_id: int | None = None) -> None:
        self.pulling.discard(req_id)
        self._updates.arrived.append(RemoteKVArrived(req_id, num_tokens, first_token_id))

    def fail(self, req_id: int, message: str = "producer_unreachable", *, recompute: bool = True) -> None:
        self.pulling.discard(req_id)
        self._updates.failed.append(RemoteKVFailed(req_id, message, recompute))

    def stop_pull(self, req_id: int) -> None:
        """A pull that `abort_pull` cancelled has let go of its blocks."""
        self._updates.pulls_stopped.append(req_id)

    def end_lease(self, req_id: int) -> None:
        del self.leased[req_id]
        self._updates.leases_ended.append(req_id)

    # -- the scheduler's hooks --------------------------------------------------------------
    def blocks_reserved(self, request: Request, block_ids: Sequence[int]) -> None:
        assert request.req_id not in self.reserved, f"request {request.req_id} reserved twice"
        self.reserved[request.req_id] = list(block_ids)
        self.pulling.add(request.req_id)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> dict[str, Any] | None:
        self.finished.append((request.req_id, request.finish_reason))
        leasable = request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if request.req_id not in self.producer_ids or not leasable:
            return None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        self.leased[request.req_id] = list(block_ids[:num_blocks])
        return {"transfer_id": f"t-{request.req_id}", "block_ids": self.leased[request.req_id]}

    def abort_pull(self, request: Request) -> bool:
        if request.req_id not in self.pulling:
            return False
        self.pulling.discard(request.req_id)
        self.aborted_pulls.append(request.req_id)
        return True

    def take_updates(self) -> KVConnectorUpdates:
        updates, self._updates = self._updates, KVConnectorUpdates()
        return updates

    # -- the engine core's hooks (unused by scheduler tests) ---------------------------------
    def prepare(self, request: Request, raw_params: Any) -> None:
        raise NotImplementedError("scheduler tests queue requests directly")

    def release_request(self, client_id: str) -> bool:
        return False

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return bool(self.pulling)

    @property
    def num_leases_held(self) -> int:
        return len(self.leased)

    @property
    def stats_version(self) -> int:
        return 0

    def stats_totals(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
