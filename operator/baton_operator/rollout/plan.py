"""The decode-first sequence of a KV-compatibility key change, as a pure function.

A change of the key (block size, KV dtype, model...) makes the new pods unable to exchange KV
with the old ones, so the pools cannot each roll on their own: a new prefill pod would have no
decode pod to hand its KV to, and the old prefill pods would lose theirs. Instead the old pods
keep serving as one generation while a new generation grows beside it, one pod at a time:

* decode first: a new decode pod is Ready before the new prefill pods that pair with it start;
* each generation keeps the spec's P:D ratio within one pod: |p*D - d*P| <= max(P, D) with spare
  capacity (one pod of the pool where a pod weighs least), within one pod of each pool with
  accelerator pools (new prefill pods follow the new decode pods' readiness, old prefill pods
  retire as the old decode pods do, and with spare decode capacity the last old decode pod goes
  after the last old prefill pod);
* a pool with spare capacity (no accelerators) adds before it removes (never below its spec
  count, at most one pod above); a pool of accelerator pods removes before it adds (never above
  its spec count, at most one pod below), like a Deployment's maxSurge 1 / maxUnavailable 1.

`steps()` lists the states from (new 0:0, old P:D) to (new P:D, old 0:0), each changing one
pool of one generation by one pod. `advance()` picks the state to apply from what the cluster
shows: the first state not yet reached, never undoing what the applied state already grants (a
new pod that crashes does not scale its generation back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Counts:
    """Pods of one generation, per pool."""

    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError(f"pod counts must be >= 0, got {self}")

    def covers(self, other: Counts) -> bool:
        return self.prefill >= other.prefill and self.decode >= other.decode

    def within(self, other: Counts) -> bool:
        return self.prefill <= other.prefill and self.decode <= other.decode


@dataclass(frozen=True)
class Step:
    """The replicas of each generation in one state of the rollout."""

    new: Counts
    old: Counts


@dataclass(frozen=True)
class Observed:
    """What the cluster shows of the two generations."""

    new_ready: Counts  # Ready (and not terminating) pods of the new key
    old_present: Counts  # pods of the old keys that still exist, draining ones included


@dataclass(frozen=True)
class Decision:
    """What to apply now, and how far the rollout is."""

    step: Step
    index: int  # 0-based index of `step` in the sequence (len(steps) when done)
    total: int  # states in the sequence
    done: bool  # every state reached: the old generation is gone


def steps(prefill: int, decode: int, *, surge_prefill: bool = True, surge_decode: bool = True) -> list[Step]:
    """The states of a rollout to `prefill` and `decode` new pods from as many old ones.

    Iteration i (of `decode`) moves the i-th decode pod to the new generation; the prefill pods
    follow: the new generation gets the prefill pods its i decode pods carry, ceil(i*P/D), the
    old one keeps those its remaining D-i decode pods need (with spare capacity at most one pod
    more than the spec in all, without none)."""
    if prefill < 0 or decode < 0:
        raise ValueError(f"replicas must be >= 0, got prefill={prefill}, decode={decode}")
    new, old = Counts(), Counts(prefill, decode)
    out: list[Step] = []
    budget = 1 if surge_prefill else 0  # prefill pods allowed above the spec count

    def move(new_: Counts, old_: Counts) -> None:
        nonlocal new, old
        new, old = new_, old_
        out.append(Step(new, old))

    def prefill_to(new_target: int, old_target: int) -> None:
        # Both targets round up, so together they may exceed the spec by one pod: without room
        # for it the old generation keeps what it needs and the new one gets the rest.
        new_target = min(new_target, prefill + budget - old_target)
        while new.prefill < new_target or old.prefill > old_target:
            room = new.prefill + old.prefill < prefill + budget
            if new.prefill < new_target and (room or old.prefill <= old_target):
                move(Counts(new.prefill + 1, new.decode), old)
            else:
                move(new, Counts(old.prefill - 1, old.decode))

    if decode == 0:  # no decode pool to lead (a pool scaled to zero): prefill alone
        prefill_to(prefill, 0)
        return out
    for i in range(1, decode + 1):
        carried = math.ceil(i * prefill / decode)  # prefill pods i new decode pods carry
        needed = math.ceil((decode - i) * prefill / decode)  # ... the old decode pods left need
        if surge_decode:
            move(Counts(new.prefill, i), old)
            prefill_to(carried, needed)
            move(new, Counts(old.prefill, decode - i))
        else:
            move(new, Counts(old.prefill, decode - i))
            move(Counts(new.prefill, i), old)
            prefill_to(carried, needed)
    return out


def reached(step: Step, observed: Observed) -> bool:
    """The new generation has `step.new` Ready pods and the old one no more than `step.old` pods."""
    return observed.new_ready.covers(step.new) and observed.old_present.within(step.old)


def advance(sequence: list[Step], observed: Observed, applied: Step) -> Decision:
    """The state to apply: the first one not reached yet, but never fewer new or more old pods
    than `applied` (the replicas in force) already grants."""
    total = len(sequence)
    index = next((i for i, s in enumerate(sequence) if not reached(s, observed)), total)
    if index == total:
        return Decision(step=sequence[-1] if sequence else applied, index=total, total=total, done=True)
    want, target = sequence[index], sequence[-1].new
    step = Step(
        new=Counts(
            min(target.prefill, max(want.new.prefill, applied.new.prefill)),
            min(target.decode, max(want.new.decode, applied.new.decode)),
        ),
        old=Counts(min(want.old.prefill, applied.old.prefill), min(want.old.decode, applied.old.decode)),
    )
    return Decision(step=step, index=index, total=total, done=False)
