"""Grammars for constrained decoding, built from OpenAI request fields (torch-free).

A grammar is llguidance's serialized form (a JSON string): it travels in
`SamplingParams.grammar` from the server to the engine core, where a `GrammarMatcher` follows
the output token by token. Errors name the request field they come from.

- ``response_format`` ``{"type": "json_object"}``: any JSON object.
- ``response_format`` ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``:
  JSON valid under the schema (enforced whether or not ``strict`` is set: a looser answer is
  never better).
- ``tool_choice`` ``required`` or a named function: one call (or several, with
  ``parallel_tool_calls``) of the offered tools, in the model family's tool-call format, each
  call's arguments valid under the tool's ``parameters`` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

ToolCallFormat = Literal["hermes", "llama3_json"]
"""``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen 2.5/3,
Hermes); ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3 JSON calls)."""

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""One canonical spacing (as ``json.dumps`` writes it): with free whitespace a weak model can
pad forever without ever closing the document."""


class StructuredOutputError(ValueError):
    """A request's grammar cannot be built; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any]


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar of an OpenAI ``response_format``, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _validated(_json_grammar({"type": "object"}, "response_format"), "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputError(
                "response_format.json_schema", "required object for type 'json_schema'"
            )
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise StructuredOutputError("response_format.json_schema.name", "required non-empty string")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise StructuredOutputError("response_format.json_schema.schema", "must be a JSON schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredOutputError("response_format.json_schema.strict", "must be a boolean")
        where = "response_format.json_schema.schema"
        return _validated(_json_grammar(schema, where), where)
    raise StructuredOutputError(
        "response_format.type", f"{kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON valid under `schema` (``SamplingParams(grammar=...)`` offline)."""
    if not isinstance(schema, dict):
        raise StructuredOutputError("schema", "must be a JSON schema object")
    return _validated(_json_grammar(schema, "schema"), "schema")


def validate_grammar(grammar: str, param: str) -> None:
    """Raise `StructuredOutputError` naming `param` unless `grammar` is a usable grammar."""
    _validated(grammar, param)


def parse_tools(tools: list[Any]) -> list[Tool]:
    """OpenAI ``tools`` (``[{"type": "function", "function": {"name", "parameters"}}]``)."""
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise StructuredOutputError(f"{where}.type", "only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise StructuredOutputError(f"{where}.function", "required object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise StructuredOutputError(f"{where}.function.name", "required non-empty string")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise StructuredOutputError(f"{where}.function.parameters", "must be a JSON schema object")
        _validated(_json_grammar(parameters, f"{where}.function.parameters"), f"{where}.function.parameters")
        parsed.append(Tool(name, parameters))
    names = [t.name for t in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise StructuredOutputError("tools", f"function name {duplicate!r} is offered twice")
    return parsed


def tool_call_grammar(tools: list[Tool], fmt: ToolCallFormat, *, parallel: bool) -> str:
    """Output that is one call (or, with `parallel`, one or more) of `tools` in format `fmt`."""
    if not tools:
        raise StructuredOutputError("tools", "tool_choice requires at least one tool")
    arguments_key = "arguments" if fmt == "hermes" else "parameters"
    bodies = []
    for i, tool in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                arguments_key: _rebased(tool.parameters, f"#/properties/{arguments_key}"),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }
        bodies.append(f"call_{i}: %json {json.dumps(schema)}")
    if fmt == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        repeat = '("\\n" call)*' if parallel else ""
    else:
        call = "call: body"
        repeat = '("; " call)*' if parallel else ""
    lark = "\n".join(
        [
            f"start: call {repeat}",
            call,
            "body: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            *bodies,
        ]
    )
    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a ``$ref`` in them is left alone."""
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names (any, ``const`` included) to schemas."""


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with its local references (``#``, ``#/$defs/...``) pointing into the document it
    is embedded in at JSON pointer `root`: a tool's parameters become one property of the
    call's schema, and pydantic-made parameters (``openai.pydantic_function_tool``) refer to
    their own ``$defs``."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out


def tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches its model, or None if it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if '"parameters"' in chat_template or "<|python_tag|>" in chat_template:
        return "llama3_json"
    return None


def _json_grammar(schema: dict[str, Any], param: str) -> str:
    try:
        # Serialized here, strictly: a NaN or an infinity (Python's JSON decoder takes them)
        # would otherwise reach llguidance as null, and an integer beyond 64 bits makes its
        # Python binding raise a bare ValueError.
        text = json.dumps(schema, allow_nan=False)
    except ValueError as exc:
        raise StructuredOutputError(param, "cannot be enforced: numbers must be finite") from exc
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StructuredOutputError(param, f"cannot be enforced: {exc}") from exc


def _validated(grammar: str, param: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise StructuredOutputError(param, f"cannot be enforced: {messages[0]}")
    return grammar
