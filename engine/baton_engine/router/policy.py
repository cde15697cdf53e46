"""Which pod gets a request. Pure functions of the candidates' observed state.

Prefill (and aggregated) pods are ranked by the longest cached prefix of the request, then by
load (waiting requests, then running), then by requests this router has in flight to the pod
(scrapes are a second old; this spreads a burst). Decode pods are ranked by KV-cache usage, then
running requests, then in-flight. A metric that could not be read ranks after any known value.
Full ties go to the candidate ``turn`` places along the key order (``turn`` counts the router's
choices), so that prefixes no pod has cached yet are spread over the pool instead of all landing
on the first pod; the choice stays a deterministic function of the inputs. Round-robin ignores
all of that and walks the candidates in key order; it exists as a baseline for comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


def _prefill_load(c: Candidate) -> tuple[float, float, float, int]:
    return (-c.prefix_blocks, _known(c.waiting), _known(c.running), c.in_flight)


def _decode_load(c: Candidate) -> tuple[float, float, int]:
    return (_known(c.kv_usage), _known(c.running), c.in_flight)


def _ranked(
    candidates: Sequence[Candidate], load: Callable[[Candidate], tuple[float, ...]], turn: int
) -> list[Candidate]:
    ordered = sorted(candidates, key=lambda c: c.key)
    n = len(ordered)
    rotation = {c.key: (i - turn) % n for i, c in enumerate(ordered)}
    return sorted(ordered, key=lambda c: (load(c), rotation[c.key]))


def _round_robin(candidates: Sequence[Candidate], turn: int) -> Candidate:
    ordered = sorted(candidates, key=lambda c: c.key)
    return ordered[turn % len(ordered)]


def choose_prefill(candidates: Sequence[Candidate], routing: Routing = "prefix", turn: int = 0) -> Candidate:
    """The pod to prefill on (also the pod of an aggregated pool). ``turn`` drives round-robin."""
    if not candidates:
        raise ValueError("choose_prefill: no candidates")
    if routing == "round-robin":
        return _round_robin(candidates, turn)
    return _ranked(candidates, _prefill_load, turn)[0]


def choose_decode(candidates: Sequence[Candidate], routing: Routing = "prefix", turn: int = 0) -> Candidate:
    """The pod to decode on."""
    if not candidates:
        raise ValueError("choose_decode: no candidates")
    if routing == "round-robin":
        return _round_robin(candidates, turn)
    return _ranked(candidates, _decode_load, turn)[0]


def rank_decode(candidates: Sequence[Candidate], turn: int = 0) -> list[Candidate]:
    """Decode candidates best first (the router tries the next one when a pod refuses connections)."""
    return _ranked(candidates, _decode_load, turn)
