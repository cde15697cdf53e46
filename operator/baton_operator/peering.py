"""Whether this operator replica is the active Kopf peer, for the work the operator runs outside
Kopf's handlers (the per-resource jobs of `workers`).

Kopf pauses its watches and handlers while another live peer has a higher priority (or the same
one); the jobs must pause with it. Kopf has no public signal for that, but its peering protocol
is public: each peer keeps `status.<identity> = {priority, lastseen, lifetime}` in the peering
object (ClusterKopfPeering, or a KopfPeering per watched namespace). `PeerView` reads those
objects every few seconds and applies Kopf's rule; standalone operators are always active.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from baton_operator.kube import Kube, KubeError

log = logging.getLogger(__name__)

#: How often the peering objects are read.
REFRESH_S = 3.0


@dataclass(frozen=True)
class Peer:
    identity: str
    priority: int
    lastseen: dt.datetime
    lifetime_s: float

    def alive(self, now: dt.datetime) -> bool:
        return self.lastseen + dt.timedelta(seconds=self.lifetime_s) > now


def peers_of(status: Mapping[str, Any]) -> list[Peer]:
    """The peers a peering object's status lists (entries Kopf would not parse are skipped)."""
    peers = []
    for identity, info in status.items():
        if not isinstance(info, Mapping):
            continue
        try:
            lastseen = dt.datetime.fromisoformat(str(info["lastseen"]).replace("Z", "+00:00"))
            if lastseen.tzinfo is None:
                lastseen = lastseen.replace(tzinfo=dt.UTC)
            peers.append(
                Peer(identity, int(info.get("priority", 0)), lastseen, float(info.get("lifetime", 60)))
            )
        except (KeyError, TypeError, ValueError):
            continue
    return peers


def paused_by(peers: list[Peer], identity: str, priority: int, now: dt.datetime) -> list[Peer]:
    """The live peers that make Kopf pause this one: higher priority, or the same."""
    return [p for p in peers if p.identity != identity and p.alive(now) and p.priority >= priority]


class PeerView:
    """Kopf's active/paused state of this replica, refreshed every REFRESH_S by a task."""

    def __init__(self, kube: Kube, paths: list[str], identity: str, priority: int) -> None:
        self.kube = kube
        self.paths = paths  # the peering objects' API paths; none: standalone
        self.identity = identity
        self.priority = priority
        self._active = not paths
        self._task: asyncio.Task[None] | None = None

    def active(self) -> bool:
        return self._active

    def start(self) -> None:
        if self.paths and self._task is None:
            self._task = asyncio.create_task(self._refresh_forever(), name="peering view")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> bool:
        now = dt.datetime.now(dt.UTC)
        blocking: list[Peer] = []
        for path in self.paths:
            body = await self.kube.get_path(path)
            if body is not None:
                blocking += paused_by(peers_of(body.get("status") or {}), self.identity, self.priority, now)
        active = not blocking
        if active != self._active:
            log.info("periodic work %s (peers: %s)", "resumed" if active else "paused", blocking)
        self._active = active
        return active

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except KubeError as exc:
                log.warning("reading the peering objects failed: %s", exc)
            await asyncio.sleep(REFRESH_S)
