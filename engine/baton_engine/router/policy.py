"""Which pod gets a request. Pure functions of the candidates' observed state.

Prefill (and aggregated) pods are ranked by the longest cached prefix of the request, then by
load (waiting requests, then running), then by requests this router has in flight to the pod
(scrapes are a second old; this spreads a burst), then by key so that ties are deterministic.
Decode pods are ranked by KV-cache usage, then running requests, then in-flight, then key. A
metric that could not be read ranks after any known value. Round-robin ignores all of that and
walks the candidates in key order; it exists as a baseline for comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Routing = Literal["prefix", "round-robin"]
ROUTINGS: tuple[str, ...] = ("prefix", "round-robin")


@dataclass(frozen=True)
class Candidate:
    key: str
    prefix_blocks: int = 0  # cached prompt blocks the pod holds for this request
    waiting: float | None = None  # None: unknown (metrics unreadable or not scraped yet)
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    in_flight: int = 0  # requests this router has open to the pod


def _known(value: float | None) -> float:
    return math.inf if value is None else value


def _prefill_rank(c: Candidate) -> tuple[float, float, float, int, str]:
    return (-c.prefix_blocks, _known(c.waiting), _known(c.running), c.in_flight, c.key)


def _decode_rank(c: Candidate) -> tuple[float, float, int, str]:
    return (_known(c.kv_usage), _known(c.running), c.in_flight, c.key)


def _round_robin(candidates: Sequence[Candidate], turn: int) -> Candidate:
    ordered = sorted(candidates, key=lambda c: c.key)
    return ordered[turn % len(ordered)]


def choose_prefill(candidates: Sequence[Candidate], routing: Routing = "prefix", turn: int = 0) -> Candidate:
    """The pod to prefill on (also the pod of an aggregated pool). ``turn`` drives round-robin."""
    if not candidates:
        raise ValueError("choose_prefill: no candidates")
    if routing == "round-robin":
        return _round_robin(candidates, turn)
    return min(candidates, key=_prefill_rank)


def choose_decode(candidates: Sequence[Candidate], routing: Routing = "prefix", turn: int = 0) -> Candidate:
    """The pod to decode on."""
    if not candidates:
        raise ValueError("choose_decode: no candidates")
    if routing == "round-robin":
        return _round_robin(candidates, turn)
    return min(candidates, key=_decode_rank)


def rank_decode(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Decode candidates best first (the router tries the next one when a pod refuses connections)."""
    return sorted(candidates, key=_decode_rank)
