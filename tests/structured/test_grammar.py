"""Grammars from OpenAI fields, followed by a matcher over SmolLM2's real tokenizer, with the
mask applied to logits as the sampler applies it: every sampled document is valid."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from pydantic import BaseModel

from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.server.tool_calls import parse_tool_calls
from baton_engine.structured.grammar import (
    StructuredOutputError,
    ToolCallFormat,
    parse_tools,
    response_format_grammar,
    tool_call_format,
    tool_call_grammar,
)
from baton_engine.structured.matcher import GrammarMatcher, allowed, bitmask_words, grammar_tokenizer
from baton_engine.text.tokenizer import Tokenizer
from baton_engine.worker.token_bitmask import apply_token_bitmask_host

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "unit", "days", "alerts"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:smollm2-135m-instruct")


def _matcher(tokenizer: Tokenizer, grammar: str) -> GrammarMatcher:
    llt = grammar_tokenizer(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    return GrammarMatcher(llt, grammar)


def _sample(tokenizer: Tokenizer, grammar: str, seed: int, max_tokens: int = 200) -> str:
    """Random logits, masked as the sampler masks them, argmax; until the grammar is done."""
    matcher = _matcher(tokenizer, grammar)
    generator = torch.Generator().manual_seed(seed)
    vocab = tokenizer.vocab_size
    bitmask = np.full((1, bitmask_words(vocab)), -1, dtype=np.int32)
    eos = tokenizer.eos_token_ids[0]
    out: list[int] = []
    for _ in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, vocab, generator=generator)
        apply_token_bitmask_host(logits, bitmask)
        token = int(logits.argmax(dim=-1))
        assert allowed(bitmask, 0, token)
        if token == eos:
            assert matcher.accepting
            return tokenizer.decode(out)
        assert matcher.accept([token]) == 1
        out.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(8))
def test_sampled_json_is_valid_under_the_schema(tokenizer: Tokenizer, seed: int) -> None:
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    )
    assert grammar is not None
    text = _sample(tokenizer, grammar, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_mode_gives_an_object(tokenizer: Tokenizer) -> None:
    grammar = response_format_grammar({"type": "json_object"})
    assert grammar is not None
    matcher = _matcher(tokenizer, grammar)
    bitmask = np.zeros((1, bitmask_words(tokenizer.vocab_size)), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    first = [t for t in range(tokenizer.vocab_size) if allowed(bitmask, 0, t)]
    assert first and all(tokenizer.decode([t]).lstrip().startswith("{") for t in first)
    assert response_format_grammar({"type": "text"}) is None and response_format_grammar(None) is None


@pytest.mark.parametrize(
    ("response_format", "param", "message"),
    [
        ({"type": "xml"}, "response_format.type", "'xml' is not one of 'text', 'json_object', 'json_schema'"),
        ({"type": "json_schema"}, "response_format.json_schema", "required object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
         "required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
         "response_format.json_schema.schema", "must be a JSON schema object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
         "response_format.json_schema.schema", "cannot be enforced: Invalid type: objectx"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
         "response_format.json_schema.schema", "cannot be enforced: Pointer '/nope' does not exist"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
         "response_format.json_schema.strict", "must be a boolean"),
    ],
)  # fmt: skip
def test_bad_response_formats_name_the_field(
    response_format: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(StructuredOutputError) as caught:
        response_format_grammar(response_format)
    assert caught.value.param == param
    assert str(caught.value).startswith(f"{param}: {message}")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_calls_follow_the_hermes_format(tokenizer: Tokenizer, seed: int) -> None:
    tools = parse_tools([WEATHER, TIME])
    text = _sample(tokenizer, tool_call_grammar(tools, "hermes", parallel=False), seed)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n") : -len("\n</tool_call>")])
    assert set(call) == {"name", "arguments"}
    spec = next(t for t in tools if t.name == call["name"])
    jsonschema.validate(call["arguments"], spec.parameters)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_parallel_calls_are_one_or_more_valid_calls(tokenizer: Tokenizer, fmt: ToolCallFormat) -> None:
    tools = parse_tools([WEATHER, TIME])
    grammar = tool_call_grammar(tools, fmt, parallel=True)
    counts = []
    for seed in range(4):
        text = _sample(tokenizer, grammar, seed, max_tokens=400)
        parsed = parse_tool_calls(text, fmt)
        assert parsed.content is None and parsed.tool_calls, text
        for call in parsed.tool_calls:
            spec = next(t for t in tools if t.name == call.name)
            jsonschema.validate(json.loads(call.arguments), spec.parameters)
        counts.append(len(parsed.tool_calls))
    assert max(counts) > 1  # the grammar lets the model go on with another call


def test_a_named_tool_in_llama3_json_format(tokenizer: Tokenizer) -> None:
    tools = parse_tools([WEATHER])
    call = json.loads(_sample(tokenizer, tool_call_grammar(tools, "llama3_json", parallel=False), seed=3))
    assert call["name"] == "get_weather" and set(call) == {"name", "parameters"}
    jsonschema.validate(call["parameters"], tools[0].parameters)


@pytest.mark.parametrize(
    ("tools", "param", "message"),
    [
        ([{"type": "retrieval"}], "tools[0].type", "only tools of type 'function'"),
        ([{"type": "function"}], "tools[0].function", "required object"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name", "required non-empty"),
        ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
         "tools[1].function.parameters", "cannot be enforced"),
        ([WEATHER, WEATHER], "tools", "function name 'get_weather' is offered twice"),
    ],
)  # fmt: skip
def test_bad_tools_name_the_field(tools: list[Any], param: str, message: str) -> None:
    with pytest.raises(StructuredOutputError) as caught:
        parse_tools(tools)
    assert caught.value.param == param
    assert message in str(caught.value)


def test_drafts_the_grammar_refuses_are_cut_and_verify_masks_follow_the_drafts(tokenizer: Tokenizer) -> None:
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    assert grammar is not None
    matcher = _matcher(tokenizer, grammar)
    good = tokenizer.encode('{"city": "Paris", "unit": "celsius", "days', add_special_tokens=False)
    bad = tokenizer.encode('{"town": 1', add_special_tokens=False)
    assert matcher.valid_prefix(good) == len(good)
    assert matcher.valid_prefix(bad) == 1  # "{" then the grammar refuses "town"
    words = bitmask_words(tokenizer.vocab_size)
    bitmask = np.zeros((len(good) + 1, words), dtype=np.int32)
    matcher.fill_draft_bitmasks(good, bitmask, 0)
    assert all(allowed(bitmask, k, token) for k, token in enumerate(good))
    assert matcher.valid_prefix(good) == len(good)  # the state was rolled back
    closing = tokenizer.encode('":', add_special_tokens=False)[0]
    assert allowed(bitmask, len(good), closing)  # after the key "days" its colon follows
    assert matcher.accept(good) == len(good)


def test_tool_call_format_from_the_template() -> None:
    assert tool_call_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_call_format('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') == "llama3_json"
    assert tool_call_format("{{ messages }}") is None
    assert tool_call_format(None) is None


class _Place(BaseModel):
    city: str
    zone: str


class _Forecast(BaseModel):
    where: _Place
    days: int


TREE: dict[str, Any] = {  # refers to itself as "#"
    "type": "object",
    "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["label", "children"],
    "additionalProperties": False,
}
NAMED_CONST: dict[str, Any] = {  # a property named like a keyword whose values are data
    "$defs": {"Zone": {"enum": ["UTC", "CET"]}},
    "type": "object",
    "properties": {"const": {"$ref": "#/$defs/Zone"}},
    "required": ["const"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_tool_parameters_that_refer_to_their_own_definitions(
    tokenizer: Tokenizer, fmt: ToolCallFormat
) -> None:
    """The official client's ``pydantic_function_tool`` writes ``$defs`` and ``#/$defs/...``
    references; embedded in a call's schema they still point into the tool's parameters."""
    import openai

    forecast = openai.pydantic_function_tool(_Forecast, name="forecast")
    assert "$defs" in forecast["function"]["parameters"]
    tree = {"type": "function", "function": {"name": "tree", "parameters": TREE}}
    named = {"type": "function", "function": {"name": "zone", "parameters": NAMED_CONST}}
    grammar = tool_call_grammar(parse_tools([forecast, tree, named]), fmt, parallel=True)
    key = "arguments" if fmt == "hermes" else "parameters"
    calls = [
        ("forecast", {"where": {"city": "Paris", "zone": "CET"}, "days": 3}),
        ("tree", {"label": "a", "children": [{"label": "b", "children": []}]}),
        ("zone", {"const": "UTC"}),
    ]
    texts = [json.dumps({"name": name, key: arguments}) for name, arguments in calls]
    hermes = "\n".join(f"<tool_call>\n{t}\n</tool_call>" for t in texts)
    text = hermes if fmt == "hermes" else "; ".join(texts)
    matcher = _matcher(tokenizer, grammar)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.accept(tokens) == len(tokens) and matcher.accepting
    for wrong in ('{"where": {"city": "Paris"}, "days": 3}', '{"label": "a", "children": [{"label": "b"}]}'):
        name = "forecast" if "where" in wrong else "tree"
        bad = f'{{"name": "{name}", "{key}": {wrong}}}'
        bad = f"<tool_call>\n{bad}\n</tool_call>" if fmt == "hermes" else bad
        refused = _matcher(tokenizer, grammar)
        bad_tokens = tokenizer.encode(bad, add_special_tokens=False)
        assert refused.accept(bad_tokens) < len(bad_tokens)
