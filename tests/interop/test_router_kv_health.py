"""A pod whose KV events Baton cannot decode is no longer silent: the router counts each rejected
batch (`baton_router_kv_events_rejected_batches_total{pod}`) and its /ready shows the pod's
stream, the last error included, while a good pod's stream shows its encoding."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq

from baton_engine import contract
from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.wire import encode_sequence
from baton_engine.router.app import create_app
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, static_endpoint
from baton_engine.router.kv_index import KVEventIndex
from baton_engine.router.settings import RouterSettings
from baton_support.wait import wait_for
from tests.prefix.records import BlocksStored
from tests.router.fake_engine import FakeEngine
from tests.router.servers import ServerThread, stop_all

TOPIC = "kv@pod@smollm2"


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


class BadPeer:
    """Publishes batches in a format nobody speaks (a map where the batch array should be)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def subscribed(self) -> bool:
        return bool(self.pub.poll(0)) and self.pub.recv()[:1] == b"\x01"

    def send_bad(self) -> None:
        payload = msgpack.packb({"ts": 1.0, "events": []})
        self.pub.send_multipart([TOPIC.encode(), encode_sequence(self.seq), payload])
        self.seq += 1

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peers() -> Iterator[tuple[KVEventPublisher, BadPeer]]:
    good = KVEventPublisher("tcp://127.0.0.1:*", TOPIC, replay_endpoint="tcp://127.0.0.1:*")
    bad = BadPeer()
    yield good, bad
    good.shutdown()
    bad.close()


def test_rejected_batches_are_counted_and_shown(peers: tuple[KVEventPublisher, BadPeer]) -> None:
    good, bad = peers
    engines = [ServerThread(FakeEngine(name)).start() for name in ("good", "bad", "decode")]
    registry = EndpointRegistry()
    assert good.replay_endpoint is not None
    good_pod = Endpoint(
        role="prefill",
        url=engines[0].url,
        ports={"kv-events": _port(good.endpoint), "kv-replay": _port(good.replay_endpoint)},
    )
    bad_pod = Endpoint(role="prefill", url=engines[1].url, ports={"kv-events": _port(bad.endpoint)})
    registry.upsert(good_pod)
    registry.upsert(bad_pod)
    registry.upsert(static_endpoint(contract.ROLE_DECODE, engines[2].url))
    index = KVEventIndex()
    app = create_app(RouterSettings(scrape_timeout_s=10.0), registry, kv_index=index)
    server = ServerThread(app, lifespan="on").start()
    try:
        wait_for(lambda: len(index.subscriber.pods()) == 2, message="both prefill pods subscribed")
        wait_for(bad.subscribed, message="the bad pod's subscriber")
        for _ in range(3):
            bad.send_bad()
        filler = iter(range(10**6))

        def good_applied() -> bool:
            stats = index.stats().get(good_pod.key)
            if stats is not None and stats.batches_applied > 0:
                return True
            good.publish([BlocksStored((2**60 + next(filler),), None, tuple(range(16)), 16)])
            return False

        wait_for(good_applied, message="a batch of the good pod applied")
        wait_for(lambda: index.stats()[bad_pod.key].rejected_batches == 3, message="three rejected batches")

        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        line = f'{contract.M_ROUTER_KV_EVENTS_REJECTED}{{pod="{bad_pod.key}"}} 3.0'
        assert line in metrics.splitlines()
        assert f'{contract.M_ROUTER_KV_EVENTS_REJECTED}{{pod="{good_pod.key}"}} 0.0' in metrics.splitlines()

        ready = wait_for(
            lambda: (r := httpx.get(server.url + "/ready", timeout=30)).status_code == 200 and r,
            message="the router ready (every pod scraped)",
        )
        streams = ready.json()["kv_events"]
        assert streams[bad_pod.key] == {
            "next_sequence": 3,
            "batches_applied": 0,
            "rejected_batches": 3,
            "encoding": None,
            "last_error": "batch 2: EventBatch must be an array [ts, events, data_parallel_rank]",
        }
        assert streams[good_pod.key]["encoding"] == "map"
        assert streams[good_pod.key]["rejected_batches"] == 0
    finally:
        stop_all([server, *engines])
