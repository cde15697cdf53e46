"""The autoscaler tick's history record: what a restarted operator reads back from status."""

from __future__ import annotations

import json

from baton_operator.autoscaler.policy_types import History, Recommendation, ScaleAction
from baton_operator.autoscaler.status_record import history_to_dict
from baton_operator.autoscaler.tick import stored_history


def _body(history: str | None) -> dict[str, object]:
    return {"status": {"autoscaling": {"history": history}}}


def test_history_written_to_status_is_read_back() -> None:
    history = History(
        (Recommendation(100.0, "prefill", 2), Recommendation(101.5, "decode", 1)),
        (ScaleAction(100.0, "prefill", 1, 2),),
    )
    text = json.dumps(history_to_dict(history), separators=(",", ":"))
    assert stored_history(_body(text)) == history


def test_missing_or_corrupt_history_starts_empty() -> None:
    assert stored_history({}) == History()
    assert stored_history(_body(None)) == History()
    assert stored_history(_body("not json")) == History()
    assert stored_history(_body('{"recommendations": [[1.0, "prefill", -3]]}')) == History()
