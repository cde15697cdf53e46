"""The core's structured-output state driven as the step loop will drive it: a batch mixing
constrained and free rows, drafts cut and verified under the masks, a P/D decode leg replaying
its first token, a preemption rolling back; every constrained answer is schema-valid."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.structured.bitmask import apply_bitmask
from baton_engine.structured.grammar import StructuredOutputError, response_format_grammar
from baton_engine.structured.manager import SampledRow, StructuredOutputManager
from baton_engine.text.tokenizer import Tokenizer

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FLAGS: dict[str, Any] = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}


def _grammar(schema: dict[str, Any]) -> str:
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert grammar is not None
    return grammar


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:smollm2-135m-instruct")


@pytest.fixture()
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_a_mixed_batch_decodes_valid_documents_and_leaves_free_rows_alone(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    eos = tokenizer.eos_token_ids[0]
    schemas = {"a": PERSON, "c": FLAGS}
    for request_id, schema in schemas.items():
        manager.add(request_id, _grammar(schema))
    outputs: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    done: set[str] = set()
    generator = torch.Generator().manual_seed(1)
    for _ in range(120):
        live = [r for r in ("a", "b", "c") if r not in done]
        if not live:
            break
        rows = [SampledRow(r, i) for i, r in enumerate(live)]
        logits = torch.randn(len(live), tokenizer.vocab_size, generator=generator)
        free = logits[live.index("b")].clone() if "b" in live else None
        step = manager.step_bitmask(rows)
        assert step is not None and step.logits_rows == [i for i, r in enumerate(live) if r != "b"]
        apply_bitmask(logits, torch.from_numpy(step.bitmask), torch.tensor(step.logits_rows))
        if free is not None:
            assert torch.equal(logits[live.index("b")], free)  # the free row is untouched
        tokens = logits.argmax(dim=-1).tolist()
        for request_id, token in zip(live, tokens, strict=True):
            if request_id == "b":
                outputs["b"].append(token)
                if len(outputs["b"]) == 10:
                    done.add("b")
                continue
            finished = manager.accept(request_id, [token])
            if token != eos:
                outputs[request_id].append(token)
            if finished:
                done.add(request_id)
                manager.remove(request_id)
    assert done == {"a", "b", "c"}
    for request_id, schema in schemas.items():
        jsonschema.validate(json.loads(tokenizer.decode(outputs[request_id])), schema)
    assert len(manager) == 0


def test_drafts_the_grammar_refuses_are_cut_and_verify_rows_get_one_mask_per_position(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    manager.add("r", _grammar(PERSON))
    good = tokenizer.encode('{"name": "Ada", "age', add_special_tokens=False)
    bad = tokenizer.encode('{"nickname": "x"', add_special_tokens=False)
    assert manager.cut_drafts("r", good) == good
    assert manager.cut_drafts("r", bad) == bad[:1]
    assert manager.cut_drafts("free", bad) == bad  # unconstrained requests keep their drafts
    step = manager.step_bitmask([SampledRow("free", 0), SampledRow("r", 1, tuple(good))])
    assert step is not None
    assert step.logits_rows == list(range(1, 2 + len(good)))
    assert step.bitmask.shape[0] == 1 + len(good)
    for k, token in enumerate(good):
        assert (int(step.bitmask[k, token // 32]) >> (token % 32)) & 1
    assert manager.accept("r", good[:3]) is False  # two drafts accepted plus the bonus token


def test_a_decode_leg_continues_from_the_prefill_legs_first_token(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    first = tokenizer.encode("{", add_special_tokens=False)
    manager.add("decode-leg", _grammar(PERSON), replay=first)
    rest = tokenizer.encode('"name": "Bo", "age": 7}', add_special_tokens=False)
    assert manager.accept("decode-leg", rest) is True
    with pytest.raises(StructuredOutputError) as caught:
        manager.add("bad-leg", _grammar(PERSON), replay=tokenizer.encode("[", add_special_tokens=False))
    assert caught.value.param == "kv_transfer_params"


def test_preemption_rolls_back_and_the_recompute_replays(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    manager.add("p", _grammar(PERSON))
    tokens = tokenizer.encode('{"name": "Al", "age": 3', add_special_tokens=False)
    assert manager.accept("p", tokens) is False
    manager.rollback("p", len(tokens))
    assert manager.accept("p", tokens) is False  # the same tokens again, from the start
    closing = tokenizer.encode("}", add_special_tokens=False)
    assert manager.accept("p", closing + [tokenizer.eos_token_ids[0]]) is True


def test_a_token_outside_the_grammar_is_a_bug_not_input(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    manager.add("x", _grammar(FLAGS))
    with pytest.raises(RuntimeError, match="broke its grammar"):
        manager.accept("x", tokenizer.encode("{", add_special_tokens=False))
    with pytest.raises(ValueError, match="already has a grammar"):
        manager.add("x", _grammar(FLAGS))
