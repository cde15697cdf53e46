"""What one tick leaves behind once its replica writes are done: pure bookkeeping.

Each pool's resize is its own write, and a refused write does not undo the other pool's. So the
history keeps exactly the scale actions that were written (the cool-down and the windows of the
next ticks count from them), the scale-action metric counts exactly those, and each pool gets one
Event: Normal for a resize done, Warning naming the pool and the API's reason for one refused.
Recommendations stay whatever happened to the writes: they record the load, not the replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from baton_operator.events import Event

from .policy_types import Decision, History, RoleDecision, ScaleAction
from .telemetry import scale_event

SCALE_FAILED = "ScaleFailed"


@dataclass(frozen=True)
class WriteFailure:
    """Why a pool's replica write was not done."""

    status: int  # HTTP status; 0 when no answer came
    reason: str  # the API's Status reason (Invalid, Forbidden, Conflict); "" when it gave none
    message: str

    def describe(self) -> str:
        if self.status == 0:
            return f"no answer from the API server: {self.message}"
        return f"{self.reason or 'no reason given'} (HTTP {self.status}): {self.message}"


#: Per resized pool (role): None when its write was done, else why not.
WriteResults = Mapping[str, WriteFailure | None]


@dataclass(frozen=True)
class Settled:
    history: History  # decide's history without the actions that were not written
    written: tuple[RoleDecision, ...]  # pools resized, in decision order
    failed: tuple[tuple[RoleDecision, WriteFailure], ...]
    events: tuple[Event, ...]  # one per resized or refused pool, in decision order
    scale_actions: tuple[tuple[str, str], ...]  # (role, direction): scale-action metric increments
    scale_failures: tuple[tuple[str, str], ...]  # (role, direction): scale-failure metric increments

    def failure_summary(self) -> str:
        """One line for the log and the retry: each refused pool and why; "" when none was."""
        return "; ".join(f"{r.role}: {failure.describe()}" for r, failure in self.failed)


def resized(decision: Decision) -> tuple[RoleDecision, ...]:
    """The pools whose replicas this decision changes: the ones to write."""
    return tuple(r for r in decision.roles if r.desired != r.current)


def failure_event(role: RoleDecision, failure: WriteFailure) -> Event:
    return Event(
        "Warning",
        SCALE_FAILED,
        f"{role.role}: scale {role.action} {role.current} -> {role.desired} not written: "
        f"{failure.describe()}",
    )


def settle(decision: Decision, history: History, writes: WriteResults) -> Settled:
    """The history, Events and metric increments of `decision` given each resized pool's write
    result. `history` is what ``decide`` returned with it (an action for every resized pool)."""
    wanted = {r.role for r in resized(decision)}
    if set(writes) != wanted:
        extra, missing = sorted(set(writes) - wanted), sorted(wanted - set(writes))
        raise ValueError(
            f"settle: write results must be for the resized pools {sorted(wanted)}; "
            f"unexpected {extra}, missing {missing}"
        )
    written: list[RoleDecision] = []
    failed: list[tuple[RoleDecision, WriteFailure]] = []
    events: list[Event] = []
    for r in resized(decision):
        failure = writes[r.role]
        if failure is None:
            written.append(r)
            reason_message = scale_event(r)
            if reason_message is not None:
                events.append(Event("Normal", *reason_message))
        else:
            failed.append((r, failure))
            events.append(failure_event(r, failure))
    not_written = {ScaleAction(decision.at, r.role, r.current, r.desired) for r, _ in failed}
    kept = dataclasses.replace(history, actions=tuple(a for a in history.actions if a not in not_written))
    return Settled(
        kept,
        tuple(written),
        tuple(failed),
        tuple(events),
        tuple((r.role, r.action) for r in written),
        tuple((r.role, r.action) for r, _ in failed),
    )
