"""Prefix-aware choice through the seams (the real KV-event index and hash plug into these)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx

from baton_engine.router.endpoints import Endpoint
from baton_engine.router.prefix import PrefixScorer, literal_token_ids

BLOCK = 4


class ChunkHasher:
    """Block hash = the block's tokens plus its parent's hash (a chain, as the engines' hash is)."""

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        hashes, parent = [], 0
        for start in range(0, len(token_ids) - len(token_ids) % BLOCK, BLOCK):
            parent = hash((parent, tuple(token_ids[start : start + BLOCK])))
            hashes.append(parent)
        return hashes


class DictIndex:
    """pod address -> the block hashes it holds."""

    def __init__(self, held: Mapping[str, set[int]]) -> None:
        self.held = held

    def longest_prefix_match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        out = {}
        for pod, blocks in self.held.items():
            n = 0
            while n < len(block_hashes) and block_hashes[n] in blocks:
                n += 1
            if n:
                out[pod] = n
        return out


PROMPT = list(range(100, 114))  # 3 full blocks + 2 tokens


def test_literal_token_ids() -> None:
    assert literal_token_ids("completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert literal_token_ids("completions", {"prompt": "text"}) is None
    assert literal_token_ids("completions", {"prompt": [1, True]}) is None
    assert literal_token_ids("chat", {"prompt": [1, 2]}) is None


def test_scorer_maps_index_pods_to_endpoints() -> None:
    hashes = ChunkHasher().block_hashes(PROMPT)
    a = Endpoint(role="prefill", url="http://127.0.0.1:8001")
    b = Endpoint(role="prefill", url="http://127.0.0.2:8001", ports={"kv-events": 7001})
    index = DictIndex(
        {"127.0.0.1:5557": {hashes[0]}, "127.0.0.2:7001": set(hashes[:3]), "gone:1": set(hashes)}
    )
    scorer = PrefixScorer(hasher=ChunkHasher(), index=index)
    assert scorer.matched_blocks("completions", {"prompt": PROMPT}, [a, b]) == {a.key: 1, b.key: 3}
    assert scorer.matched_blocks("completions", {"prompt": "no tokenizer"}, [a, b]) == {}
    assert PrefixScorer().matched_blocks("completions", {"prompt": PROMPT}, [a, b]) == {}


def test_router_sends_the_prefill_leg_to_the_pod_with_the_longest_prefix(start_engine, start_router) -> None:
    cold, cold_url = start_engine("cold")
    warm, warm_url = start_engine("warm")
    decode, decode_url = start_engine("d0")
    hashes = ChunkHasher().block_hashes(PROMPT)
    warm_host = warm_url.removeprefix("http://")
    scorer = PrefixScorer(hasher=ChunkHasher(), index=DictIndex({warm_host: set(hashes[:2])}))
    router = start_router(prefill=[cold_url, warm_url], decode=[decode_url], scorer=scorer, block_size=BLOCK)
    baseline = start_router(
        prefill=[cold_url, warm_url],
        decode=[decode_url],
        scorer=scorer,
        block_size=BLOCK,
        routing="round-robin",
    )

    for _ in range(3):
        assert (
            httpx.post(router.url + "/v1/completions", json={"prompt": PROMPT}, timeout=30).status_code == 200
        )
    assert (len(cold.posts()), len(warm.posts())) == (0, 3)
    metrics = httpx.get(router.url + "/metrics", timeout=30).text
    assert "baton_router_prefix_hit_tokens_total 24.0" in metrics  # 3 requests x 2 blocks x 4 tokens

    for _ in range(4):
        assert (
            httpx.post(baseline.url + "/v1/completions", json={"prompt": PROMPT}, timeout=30).status_code
            == 200
        )
    assert (len(cold.posts()), len(warm.posts())) == (2, 5)
