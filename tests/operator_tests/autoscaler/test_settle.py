"""A tick's bookkeeping after its replica writes, case by case: given one decision (prefill 1 -> 3,
decode 3 -> 2) and each pool's write result, the exact history actions kept, Events, and metric
increments."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import Decision, History, ScaleAction
from baton_operator.autoscaler.settle import WriteFailure, WriteResults, settle
from baton_operator.events import Event

from .factories import NOW, decode_pool, history, observe, policy, prefill_pool, sample, steady

EARLIER = ScaleAction(NOW - 30, "prefill", 2, 1)  # within the windows: must survive every case
PREFILL_UP = ScaleAction(NOW, "prefill", 1, 3)
DECODE_DOWN = ScaleAction(NOW, "decode", 3, 2)
SCALED_UP = Event(
    "Normal", "ScaledUp", "prefill: scale up 1 -> 3: recommend 3 (queue depth 12 / target 4 -> 3)"
)
SCALED_DOWN = Event(
    "Normal",
    "ScaledDown",
    "decode: scale down 3 -> 2: recommend 2 (KV usage 0.30 x 3 pods / target 0.60 -> 2); "
    "highest in the last 60s: 2",
)
VAP_MESSAGE = (
    "deployments.apps \"demo-decode\" is forbidden: ValidatingAdmissionPolicy 'cap' with binding "
    "'cap' denied request: at most 2 replicas"
)
REFUSED = WriteFailure(422, "Invalid", VAP_MESSAGE)
NO_ANSWER = WriteFailure(0, "", "PATCH /apis/apps/v1/namespaces/ns/deployments/demo-prefill: timeout")
PLAIN_500 = WriteFailure(500, "", "boom")


def _decided() -> tuple[Decision, History]:
    obs = observe(
        {"prefill": 1, "decode": 3},
        sample("p0", waiting=12),
        *(sample(f"d{i}", "decode", kv=0.3) for i in range(3)),
    )
    past = history(steady("decode", 2), actions=(EARLIER,))
    return decide(policy(prefill_pool(), decode_pool()), obs, past, NOW)


@dataclass(frozen=True)
class Case:
    id: str
    writes: WriteResults
    actions: tuple[ScaleAction, ...]
    events: tuple[Event, ...]
    scaled: tuple[tuple[str, str], ...]
    refused: tuple[tuple[str, str], ...]
    summary: str


CASES = [
    Case(
        "both written",
        {"prefill": None, "decode": None},
        (EARLIER, PREFILL_UP, DECODE_DOWN),
        (SCALED_UP, SCALED_DOWN),
        (("prefill", "up"), ("decode", "down")),
        (),
        "",
    ),
    Case(
        "decode refused by an admission policy, prefill written",
        {"prefill": None, "decode": REFUSED},
        (EARLIER, PREFILL_UP),
        (
            SCALED_UP,
            Event(
                "Warning",
                "ScaleFailed",
                f"decode: scale down 3 -> 2 not written: Invalid (HTTP 422): {VAP_MESSAGE}",
            ),
        ),
        (("prefill", "up"),),
        (("decode", "down"),),
        f"decode: Invalid (HTTP 422): {VAP_MESSAGE}",
    ),
    Case(
        "prefill unanswered, decode written",
        {"prefill": NO_ANSWER, "decode": None},
        (EARLIER, DECODE_DOWN),
        (
            Event(
                "Warning",
                "ScaleFailed",
                "prefill: scale up 1 -> 3 not written: no answer from the API server: "
                "PATCH /apis/apps/v1/namespaces/ns/deployments/demo-prefill: timeout",
            ),
            SCALED_DOWN,
        ),
        (("decode", "down"),),
        (("prefill", "up"),),
        "prefill: no answer from the API server: "
        "PATCH /apis/apps/v1/namespaces/ns/deployments/demo-prefill: timeout",
    ),
    Case(
        "both refused",
        {"prefill": PLAIN_500, "decode": REFUSED},
        (EARLIER,),
        (
            Event(
                "Warning",
                "ScaleFailed",
                "prefill: scale up 1 -> 3 not written: no reason given (HTTP 500): boom",
            ),
            Event(
                "Warning",
                "ScaleFailed",
                f"decode: scale down 3 -> 2 not written: Invalid (HTTP 422): {VAP_MESSAGE}",
            ),
        ),
        (),
        (("prefill", "up"), ("decode", "down")),
        f"prefill: no reason given (HTTP 500): boom; decode: Invalid (HTTP 422): {VAP_MESSAGE}",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_settle(case: Case) -> None:
    decision, decided = _decided()
    assert decided.actions == (EARLIER, PREFILL_UP, DECODE_DOWN)  # decide records both resizes
    settled = settle(decision, decided, case.writes)
    assert settled.history.actions == case.actions
    assert settled.history.recommendations == decided.recommendations  # the load, written or not
    assert settled.events == case.events
    assert settled.scale_actions == case.scaled
    assert settled.scale_failures == case.refused
    assert [r.role for r in settled.written] == [role for role, _ in case.scaled]
    assert [(r.role, f) for r, f in settled.failed] == [(role, case.writes[role]) for role, _ in case.refused]
    assert settled.failure_summary() == case.summary


def test_a_decision_that_holds_leaves_the_history_as_decided() -> None:
    obs = observe({"prefill": 1, "decode": 1}, sample("p0", waiting=2), sample("d0", "decode", kv=0.3))
    decision, decided = decide(policy(prefill_pool(), decode_pool()), obs, History(), NOW)
    assert decision.action == "hold"
    settled = settle(decision, decided, {})
    assert settled.history == decided
    assert (settled.events, settled.scale_actions, settled.scale_failures) == ((), (), ())


@pytest.mark.parametrize(
    ("writes", "message"),
    [
        (
            {"prefill": None},
            "settle: write results must be for the resized pools ['decode', 'prefill']; "
            "unexpected [], missing ['decode']",
        ),
        (
            {"prefill": None, "decode": None, "aggregated": None},
            "settle: write results must be for the resized pools ['decode', 'prefill']; "
            "unexpected ['aggregated'], missing []",
        ),
    ],
)
def test_write_results_must_match_the_resized_pools(writes: WriteResults, message: str) -> None:
    decision, decided = _decided()
    with pytest.raises(ValueError) as err:
        settle(decision, decided, writes)
    assert str(err.value) == message
