"""The scheduler's structured-output state driven as the scheduler drives it: a batch mixing
constrained and free rows, drafts cut and verified under the masks, a P/D decode leg replaying
its first token; every constrained answer is schema-valid. (The scheduler's own use of it:
tests/core/test_scheduler_structured.py.)"""

from __future__ import annotations

import gc
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.structured.grammar import response_format_grammar
from baton_engine.structured.manager import (
    COMPILED_GRAMMARS_KEPT,
    CompiledGrammars,
    GrammarRefusedToken,
    SampledRow,
    StructuredOutputManager,
)
from baton_engine.structured.matcher import GrammarMatcher, allowed
from baton_engine.text.tokenizer import Tokenizer
from baton_engine.worker.token_bitmask import apply_token_bitmask_host

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


def _follow(manager: StructuredOutputManager, req_id: int, grammar: str) -> CompiledGrammars:
    """Add a grammar and wait until its compile ended, as the scheduler's steps see it."""
    manager.add(req_id, grammar)
    ready: list[int] = []
    failed: list[tuple[int, str]] = []
    while manager.num_compiling:
        manager.wait_compiling(timeout=1.0)
        compiled = manager.take_compiled()
        ready += compiled.ready
        failed += compiled.failed
    return CompiledGrammars(ready, failed)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:smollm2-135m-instruct")


@pytest.fixture()
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)


A, B, C = 0, 1, 2  # request ids: A and C follow a grammar, B is free text


def test_a_mixed_batch_decodes_valid_documents_and_leaves_free_rows_alone(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    eos = tokenizer.eos_token_ids[0]
    schemas = {A: PERSON, C: FLAGS}
    for req_id, schema in schemas.items():
        _follow(manager, req_id, _grammar(schema))
    outputs: dict[int, list[int]] = {A: [], B: [], C: []}
    done: set[int] = set()
    generator = torch.Generator().manual_seed(1)
    for _ in range(120):
        live = [r for r in (A, B, C) if r not in done]
        if not live:
            break
        rows = [SampledRow(r, i) for i, r in enumerate(live) if r in manager]
        logits = torch.randn(len(live), tokenizer.vocab_size, generator=generator)
        free = logits[live.index(B)].clone() if B in live else None
        step = manager.step_bitmask(rows)
        assert step.logits_rows == [i for i, r in enumerate(live) if r != B]
        apply_token_bitmask_host(logits, step.bitmask, np.asarray(step.logits_rows))
        if free is not None:
            assert torch.equal(logits[live.index(B)], free)  # the free row is untouched
        tokens = logits.argmax(dim=-1).tolist()
        for req_id, token in zip(live, tokens, strict=True):
            if req_id == B:
                outputs[B].append(token)
                if len(outputs[B]) == 10:
                    done.add(B)
                continue
            complete = manager.accept(req_id, [token])
            assert token != eos  # a complete JSON grammar ends the request before any EOS
            outputs[req_id].append(token)
            if complete:
                done.add(req_id)
                manager.remove(req_id)
    assert done == {A, B, C}
    for req_id, schema in schemas.items():
        jsonschema.validate(json.loads(tokenizer.decode(outputs[req_id])), schema)
    assert len(manager) == 0


def test_drafts_the_grammar_refuses_are_cut_and_verify_rows_get_one_mask_per_position(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    _follow(manager, A, _grammar(PERSON))
    good = tokenizer.encode('{"name": "Ada", "age', add_special_tokens=False)
    bad = tokenizer.encode('{"nickname": "x"', add_special_tokens=False)
    assert manager.cut_drafts(A, good) == good
    assert manager.cut_drafts(A, bad) == bad[:1]
    assert manager.cut_drafts(B, bad) == bad  # unconstrained requests keep their drafts
    step = manager.step_bitmask([SampledRow(A, 1, tuple(good))])
    assert step.logits_rows == list(range(1, 2 + len(good)))
    assert step.bitmask.shape == (1 + len(good), (tokenizer.vocab_size + 31) // 32)
    for k, token in enumerate(good):
        assert (int(step.bitmask[k, token // 32]) >> (token % 32)) & 1
    # the masks were computed without moving the state: two drafts and a bonus token follow
    assert manager.accept(A, good[:3]) is False
    assert manager.cut_drafts(A, good[3:]) == good[3:]


def test_a_decode_leg_continues_from_the_prefill_legs_first_token(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    _follow(manager, A, _grammar(PERSON))
    assert manager.accept(A, tokenizer.encode("{", add_special_tokens=False)) is False  # the replay
    rest = tokenizer.encode('"name": "Bo", "age": 7}', add_special_tokens=False)
    assert manager.accept(A, rest) is True
    _follow(manager, C, _grammar(PERSON))
    bracket = tokenizer.encode("[", add_special_tokens=False)
    with pytest.raises(GrammarRefusedToken, match=f"token {bracket[0]} is refused by the request's grammar"):
        manager.accept(C, bracket)


def test_eos_ends_a_complete_document_and_is_refused_before(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    eos = tokenizer.eos_token_ids[0]
    _follow(manager, A, _grammar(FLAGS))
    with pytest.raises(GrammarRefusedToken):
        manager.accept(A, tokenizer.encode("[true", add_special_tokens=False) + [eos])
    # the state holds the tokens before the refused one
    assert manager.accept(A, tokenizer.encode("]", add_special_tokens=False) + [eos]) is True


def test_the_tokenizer_is_read_once_at_the_first_grammar(tokenizer: Tokenizer) -> None:
    reads: list[int] = []

    def tokenizer_json() -> str:
        reads.append(1)
        return str(tokenizer.backend.to_str())

    manager = StructuredOutputManager(tokenizer_json, tokenizer.vocab_size, tokenizer.eos_token_ids)
    assert reads == []  # engines that never serve structured output never build the trie
    _follow(manager, A, _grammar(FLAGS))
    _follow(manager, B, _grammar(PERSON))
    assert reads == [1] and len(manager) == 2
    with pytest.raises(ValueError, match="already has a grammar"):
        _follow(manager, A, _grammar(FLAGS))
    refused = _follow(manager, C, "start: nonsense(")
    assert refused.ready == [] and [req_id for req_id, _ in refused.failed] == [C]
    assert refused.failed[0][1].startswith("grammar: ") and C not in manager and len(manager) == 2
    manager.remove(A)
    manager.remove(A)  # removing twice is harmless (a finish after an abort)
    assert len(manager) == 1


def test_one_grammar_compiles_once_and_its_copies_advance_independently(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    grammar = _grammar(PERSON)
    assert [manager.add(req_id, grammar) for req_id in (A, B)] == [False, False]  # n samples
    assert _follow(manager, C, grammar).ready == [A, B, C]  # one compile, in the order added
    assert manager.num_compiled == 1
    (opening,) = tokenizer.encode('{"', add_special_tokens=False)  # the one token a document starts with
    (comma,) = tokenizer.encode(",", add_special_tokens=False)
    assert manager.accept(A, tokenizer.encode('{"name": "Ada"', add_special_tokens=False)) is False
    step = manager.step_bitmask([SampledRow(A, 0), SampledRow(B, 1)])
    assert (allowed(step.bitmask, 0, comma), allowed(step.bitmask, 0, opening)) == (True, False)
    assert (allowed(step.bitmask, 1, comma), allowed(step.bitmask, 1, opening)) == (False, True)
    manager.remove(A)
    _follow(manager, A, grammar)  # a later request with the same schema starts from the beginning
    assert allowed(manager.step_bitmask([SampledRow(A, 0)]).bitmask, 0, opening)
    assert _follow(manager, 3, "start: (").failed[0][0] == 3
    assert manager.num_compiled == 1 and 3 not in manager  # a refused grammar is not kept
    for i in range(COMPILED_GRAMMARS_KEPT):
        _follow(manager, 10 + i, _grammar({"type": "array", "maxItems": i + 1}))
    assert manager.num_compiled == COMPILED_GRAMMARS_KEPT  # PERSON's, the least recently used, went
    _follow(manager, 30, grammar)  # compiled again; the requests already following it are unaffected
    assert manager.accept(B, tokenizer.encode('{"name": "Bo", "age": 7}', add_special_tokens=False))


def test_a_request_removed_while_its_grammar_compiles_leaves_nothing(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    grammar = _grammar(FLAGS)
    assert manager.add(A, grammar) is False
    assert (len(manager), manager.num_compiling) == (1, 1)
    manager.remove(A)  # aborted while compiling
    assert (len(manager), manager.num_compiling, A in manager) == (0, 0, False)
    _follow(manager, B, _grammar(PERSON))  # a later compile: the first one ended before it
    assert manager.take_compiled() == CompiledGrammars([], [])
    assert manager.num_compiled == 2  # the aborted request's grammar is kept to copy from
    assert manager.add(C, grammar) is True  # ... so the next request with it runs at once


def test_no_grammar_state_outlives_its_requests(
    tokenizer: Tokenizer, manager: StructuredOutputManager
) -> None:
    grammars = [_grammar({"type": "array", "maxItems": i + 1}) for i in range(COMPILED_GRAMMARS_KEPT + 3)]
    before = _live_matchers()
    for req_id in range(200):
        _follow(manager, req_id, grammars[req_id % len(grammars)])
        manager.accept(req_id, tokenizer.encode("[", add_special_tokens=False))
        manager.remove(req_id)
    assert (len(manager), manager.num_compiling, manager.num_compiled) == (0, 0, COMPILED_GRAMMARS_KEPT)
    assert _live_matchers() == before + COMPILED_GRAMMARS_KEPT  # only the compiled ones, to copy from
    manager.close()


def _live_matchers() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is GrammarMatcher)
