"""Which pod gets a request. Pure functions of the candidates' observed state.

Prefill (and aggregated) pods get a weighted score, the higher the better:

    score = prefix_weight * cached prompt tokens - load_weight * outstanding requests

where a pod's outstanding requests are its scraped waiting + running requests, or the requests
this router has in flight to it if that is more (scrapes are up to an interval old; the
in-flight count is never stale). Both terms estimate time to first token: a cached prompt token
is prefill work the pod skips, an outstanding request is work queued before this one. With the
defaults (1 per token, 256 per request) a pod holding a 512-token prefix keeps that prefix's
traffic until it has two more requests outstanding than the next pod; then the traffic spills
over instead of queueing behind one hot pod. A pod whose load could not be read ranks after
every pod with a known load. Ties go to fewer in-flight requests, then to the candidate
``turn`` places along the key order (``turn`` counts the router's choices), so prefixes no pod
has cached yet are spread over the pool; the choice stays a deterministic function of the
inputs.

Decode pods are ranked by KV-cache usage, then running requests, then in-flight (the KV
arrives with the transfer: prefix hits do not matter there). Round-robin ignores all of that
and walks the candidates in key order; it exists as a baseline for comparisons.
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
    block_size: int | None = None  # tokens per cached block on this pod; None: the weights' block size


@dataclass(frozen=True)
class PrefillWeights:
    """The prefill score's weights (router flags ``--prefix-weight`` and ``--load-weight``)."""

    prefix: float = 1.0  # per cached prompt token
    load: float = 256.0  # per outstanding (waiting or running) request
    block_size: int = 16  # tokens per cached block

    def __post_init__(self) -> None:
        for name in ("prefix", "load"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}_weight: must be a finite number >= 0, got {value}")
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")


def outstanding(c: Candidate) -> float | None:
    """Requests queued or running on the pod; None if its load is unknown."""
    if c.waiting is None or c.running is None:
        return None
    return max(c.waiting + c.running, float(c.in_flight))


def prefill_score(c: Candidate, weights: PrefillWeights) -> float:
    """The weighted score of one candidate (load unknown: its in-flight requests only)."""
    load = outstanding(c)
    load = float(c.in_flight) if load is None else load
    block_size = weights.block_size if c.block_size is None else c.block_size
    return weights.prefix * c.prefix_blocks * block_size - weights.load * load


def _known(value: float | None) -> float:
    return math.inf if value is None else value


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


def rank_prefill(
    candidates: Sequence[Candidate], weights: PrefillWeights = PrefillWeights(), turn: int = 0
) -> list[Candidate]:
    """Prefill candidates best first."""

    def key(c: Candidate) -> tuple[float, ...]:
        return (float(outstanding(c) is None), -prefill_score(c, weights), float(c.in_flight))

    return _ranked(candidates, key, turn)


def choose_prefill(
    candidates: Sequence[Candidate],
    routing: Routing = "prefix",
    turn: int = 0,
    weights: PrefillWeights = PrefillWeights(),
) -> Candidate:
    """The pod to prefill on (also the pod of an aggregated pool). ``turn`` drives round-robin."""
    if not candidates:
        raise ValueError("choose_prefill: no candidates")
    if routing == "round-robin":
        return _round_robin(candidates, turn)
    return rank_prefill(candidates, weights, turn)[0]


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
