"""Per-resource periodic work (`workers`): jobs start with a live UID, run when due or asked,
end with the resource (DELETED, another UID, ResourceGone), never run for a dead UID, pause
while the replica is not the active peer; the retry schedule; Kopf's peering rule."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest

from baton_operator import workers
from baton_operator.peering import Peer, paused_by, peers_of
from baton_operator.reconcile_job import retry_delay
from baton_operator.workers import Lease, ResourceGone, ResourceId, ResourceWorkers

LONG = 3600.0  # a due time no test reaches


def body(uid: str, name: str = "demo", rv: str = "1", **spec: Any) -> dict[str, Any]:
    meta = {"namespace": "ns", "name": name, "uid": uid, "resourceVersion": rv}
    return {"metadata": meta, "spec": spec}


class Recorder:
    """A job that runs when asked (or every `every` seconds), recording what it saw."""

    name = "recorder"

    def __init__(self, every: float | None = None, action: Callable[[Lease], Any] | None = None) -> None:
        self.every = every
        self.action = action
        self.runs: list[tuple[str, str | None, Any]] = []  # (uid, trigger, spec)
        self.ran = asyncio.Event()
        self.last: float | None = None

    def due(self, lease: Lease, now: float) -> float | None:
        if lease.requested is not None:
            return now
        if self.every is None:
            return None
        return now if self.last is None else self.last + self.every

    async def run(self, lease: Lease) -> None:
        self.last = asyncio.get_running_loop().time()
        self.runs.append((lease.id.uid, lease.take_request(), dict(lease.body["spec"])))
        self.ran.set()
        if self.action is not None:
            await self.action(lease)


class World:
    """Live UIDs as the owner watch shows them, and the jobs made per resource."""

    def __init__(self, **job: Any) -> None:
        self.live: dict[tuple[str, str], str] = {}
        self.jobs: dict[str, Recorder] = {}
        self.active = True
        self.job_args = job

    def make(self, resource: ResourceId) -> list[Recorder]:
        self.jobs[resource.uid] = Recorder(**self.job_args)
        return [self.jobs[resource.uid]]

    def is_live(self, resource: ResourceId) -> bool:
        return self.live.get(resource.key) == resource.uid

    def workers(self) -> ResourceWorkers:
        return ResourceWorkers(self.make, self.is_live, lambda: self.active)

    def see(self, w: ResourceWorkers, b: dict[str, Any]) -> Lease | None:
        self.live[("ns", b["metadata"]["name"])] = b["metadata"]["uid"]
        return w.observe(b)

    def delete(self, w: ResourceWorkers, b: dict[str, Any]) -> None:
        self.live.pop(("ns", b["metadata"]["name"]), None)
        w.forget(b)


async def ran(job: Recorder, count: int) -> None:
    async def enough() -> None:
        while len(job.runs) < count:
            job.ran.clear()
            await job.ran.wait()

    await asyncio.wait_for(enough(), 10)


async def ended(lease: Lease | None) -> None:
    assert lease is not None
    await asyncio.wait_for(_until(lambda: lease.ended), 10)


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0)


async def test_a_request_runs_with_its_trigger_and_the_newest_body() -> None:
    world = World()
    w = world.workers()
    lease = world.see(w, body("u1", maxNumSeqs=1))
    assert lease is not None
    world.see(w, body("u1", rv="2", maxNumSeqs=2))
    assert w.request(body("u1", rv="2", maxNumSeqs=2), "create") is True
    await ran(world.jobs["u1"], 1)
    assert world.jobs["u1"].runs == [("u1", "create", {"maxNumSeqs": 2})]
    assert len(w) == 1
    await w.close()


async def test_periodic_runs_repeat_and_end_with_the_deleted_resource() -> None:
    world = World(every=0.01)
    w = world.workers()
    b = body("u1")
    lease = world.see(w, b)
    await ran(world.jobs["u1"], 3)
    world.delete(w, b)
    await ended(lease)
    runs = len(world.jobs["u1"].runs)
    world.see(w, body("u2", name="other"))  # the loop goes on for others
    await ran(world.jobs["u2"], 3)
    assert len(world.jobs["u1"].runs) == runs  # nothing after the deletion
    assert len(w) == 1
    await w.close()


async def test_a_new_uid_under_the_name_ends_the_old_ones_work() -> None:
    world = World(every=0.01)
    w = world.workers()
    old = world.see(w, body("u1"))
    await ran(world.jobs["u1"], 1)
    new = world.see(w, body("u2", rv="9"))
    await ended(old)
    await ran(world.jobs["u2"], 2)
    assert old is not None and new is not None
    with pytest.raises(ResourceGone):
        old.check()
    new.check()
    assert {uid for uid, _, _ in world.jobs["u2"].runs} == {"u2"}
    # A late event of the old UID (the watch shows u2 as live) starts nothing.
    assert w.observe(body("u1", rv="3")) is None
    assert w.request(body("u1", rv="3"), "update") is False
    assert w.lease("ns", "demo") is new
    await w.close()


async def test_a_uid_the_watch_no_longer_shows_stops_at_its_next_check() -> None:
    checks: list[bool] = []

    async def write_twice(lease: Lease) -> None:
        lease.check()
        checks.append(True)
        world.live.pop(lease.id.key)  # deleted while the run is in flight
        lease.check()  # the next write: refused
        checks.append(False)

    world = World(action=write_twice)
    w = world.workers()
    lease = world.see(w, body("u1"))
    assert lease is not None
    lease.request("resume")
    await ended(lease)
    assert checks == [True]
    assert world.jobs["u1"].runs == [("u1", "resume", {})]
    await w.close()


async def test_resource_gone_from_the_api_ends_the_lease() -> None:
    async def gone(lease: Lease) -> None:
        raise ResourceGone(lease.id)

    world = World(every=0.01, action=gone)
    w = world.workers()
    lease = world.see(w, body("u1"))
    await ended(lease)
    assert len(world.jobs["u1"].runs) == 1
    await w.close()


async def test_an_unexpected_failure_is_retried_after_the_error_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "ERROR_DELAY_S", 0.05)

    async def broken(lease: Lease) -> None:
        raise RuntimeError("a bug")

    world = World(every=0.0, action=broken)
    w = world.workers()
    loop = asyncio.get_running_loop()
    started = loop.time()
    world.see(w, body("u1"))
    await ran(world.jobs["u1"], 3)
    assert loop.time() - started >= 0.1  # two error delays between three runs, not a busy loop
    await w.close()


async def test_nothing_runs_while_another_replica_is_the_active_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "INACTIVE_POLL_S", 0.01)
    world = World()
    world.active = False
    w = world.workers()
    lease = world.see(w, body("u1"))
    assert lease is not None
    lease.request("resume")
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert world.jobs["u1"].runs == []
    world.active = True
    await ran(world.jobs["u1"], 1)
    assert world.jobs["u1"].runs == [("u1", "resume", {})]
    await w.close()


async def test_close_cancels_a_run_in_flight() -> None:
    blocked = asyncio.Event()

    async def hang(lease: Lease) -> None:
        blocked.set()
        await asyncio.Event().wait()

    world = World(action=hang)
    w = world.workers()
    lease = world.see(w, body("u1"))
    assert lease is not None
    lease.request("create")
    await asyncio.wait_for(blocked.wait(), 10)
    await asyncio.wait_for(w.close(), 10)
    assert lease.ended and len(w) == 0


@pytest.mark.parametrize(
    ("failures", "resync", "delay"),
    [
        (1, 60, 10),
        (2, 60, 20),
        (3, 60, 40),
        (4, 60, 60),
        (9, 60, 60),
        (1, 2, 2),
        (6, 3600, 300),
        (20, 3600, 300),
    ],
)
def test_retry_delay_doubles_up_to_the_resync_interval_and_five_minutes(
    failures: int, resync: float, delay: float
) -> None:
    assert retry_delay(failures, resync) == delay


NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
SEEN = "2026-01-01T11:59:30.000000+00:00"


def peer(identity: str, priority: int, lastseen: str = SEEN, lifetime: float = 60) -> Peer:
    return Peer(identity, priority, dt.datetime.fromisoformat(lastseen), lifetime)


def test_peers_of_a_peering_status() -> None:
    status = {
        "me": {"priority": -5, "lastseen": SEEN, "lifetime": 60},
        "other": {"priority": -9, "lastseen": "2026-01-01T11:59:30Z", "lifetime": 60},
        "broken": {"priority": "high", "lastseen": SEEN},
        "no-time": {"priority": 1},
    }
    assert peers_of(status) == [peer("me", -5), peer("other", -9)]


@pytest.mark.parametrize(
    ("peers", "blocking"),
    [
        ([peer("me", -5)], []),
        ([peer("me", -5), peer("later", -9)], []),  # started later: lower priority
        ([peer("me", -5), peer("earlier", -2)], ["earlier"]),
        ([peer("me", -5), peer("same", -5)], ["same"]),  # Kopf pauses both on a tie
        ([peer("me", -5), peer("dead", -2, lastseen="2026-01-01T11:58:00+00:00")], []),
    ],
)
def test_kopfs_pause_rule(peers: list[Peer], blocking: list[str]) -> None:
    assert [p.identity for p in paused_by(peers, "me", -5, NOW)] == blocking
