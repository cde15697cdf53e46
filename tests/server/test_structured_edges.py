"""Structured output and tools at their edges, through the official client against a tiny random
Llama with a Llama-3.1-style template (JSON tool calls, ``tests/server/data``): forced calls in
the ``llama3_json`` format are parsed, several of them with ``parallel_tool_calls`` (whole and as
streaming deltas, one per call), ``tool_choice`` ``auto`` parses a call the model spelled and
``none`` leaves it content; a stop string cuts a constrained answer, ``max_tokens`` inside a
grammar ends with ``length``; whatever the ending, no grammar state or KV block stays behind."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from baton_engine.structured.grammar import tool_call_format
from baton_support.tiny_models import CHAT
from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.server_process import ServerProcess
from tests.server.tool_fixtures import CLOCK, LOOKUP, SCHEMAS

pytestmark = pytest.mark.slow
MODEL = "tiny-llama3"
TEMPLATE = (Path(__file__).parent / "data" / "llama3_json_tools.jinja").read_text()
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What time is it?"}]
TOOLS = [LOOKUP, CLOCK]
CLOCK_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "clock"}, "parameters": CLOCK["function"]["parameters"]},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}
"""A call of `CLOCK` in the llama3_json format, as a schema: the answer `response_format` forces
when the model may answer freely (``auto``, ``none``)."""


class Place(BaseModel):
    city: str = Field(max_length=8)
    zone: str = Field(pattern="^(UTC|CET)$")


class Forecast(BaseModel):
    where: Place
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("tiny-llama3") / MODEL
    CHAT.save(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    log = tmp_path_factory.mktemp("llama3-server") / "server.log"
    proc = ServerProcess(str(directory), *TINY_SERVER_ARGS, "--max-model-len", "1024", log_path=log)
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(server: ServerProcess) -> Iterator[None]:
    yield
    stats = server.wait_idle()
    assert (stats["num_grammar_requests"], stats["num_used_kv_blocks"]) == (0, 0)


def _chat(client: openai.OpenAI, **request: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **request)


def _streamed(client: openai.OpenAI, **request: Any) -> tuple[str, list[Any], str | None]:
    """One choice's streamed content, tool-call deltas and finish reason."""
    content, calls, finish, _ = _streamed_chunks(client, **request)
    return content, calls, finish


def _streamed_chunks(client: openai.OpenAI, **request: Any) -> tuple[str, list[Any], str | None, int]:
    """`_streamed`, and how many chunks carried the choice."""
    content, calls, finish, chunks = "", [], None, 0
    for chunk in _chat(client, **request, stream=True):
        for choice in chunk.choices:
            chunks += 1
            content += choice.delta.content or ""
            calls.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    return content, calls, finish, chunks


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_the_template_teaches_the_llama3_json_format() -> None:
    assert tool_call_format(TEMPLATE) == "llama3_json"


@pytest.mark.parametrize(("seed", "num_calls"), [(9, 1), (1, 2), (7, 3)])
def test_required_calls_are_parsed_whole_and_streamed_one_delta_per_call(
    client: openai.OpenAI, seed: int, num_calls: int
) -> None:
    request: dict[str, Any] = dict(
        tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200
    )
    whole = _chat(client, **request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == num_calls  # parallel_tool_calls defaults to true
    assert len({call.id for call in calls}) == num_calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, deltas, finish, chunks = _streamed_chunks(client, **request)
    assert (content, finish, chunks) == ("", "tool_calls", 1 + num_calls)
    assert [d.index for d in deltas] == list(range(num_calls))
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_named_function_is_called_once(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "clock"}}
    for seed in (1, 7):  # seeds whose 'required' answers call several tools
        out = _chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed, max_tokens=200)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1
        assert calls[0].function.name == "clock"
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["clock"])


def test_auto_parses_a_call_the_model_spelled_and_none_leaves_it_content(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        tools=TOOLS, temperature=1.0, seed=3, max_tokens=100, response_format=_schema_format(CLOCK_CALL)
    )
    free = _chat(client, **request, tool_choice="none")
    assert free.choices[0].finish_reason == "stop" and free.choices[0].message.tool_calls is None
    text = free.choices[0].message.content
    spelled = json.loads(text)
    jsonschema.validate(spelled, CLOCK_CALL)
    assert _streamed(client, **request, tool_choice="none") == (text, [], "stop")

    auto = _chat(client, **request, tool_choice="auto")
    choice = auto.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert choice.message.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("clock", spelled["parameters"])
    ]
    content, deltas, finish, chunks = _streamed_chunks(client, **request, tool_choice="auto")
    # the role, then the call: the text the parser held back was never sent as empty deltas
    assert (content, finish, chunks) == ("", "tool_calls", 2)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "clock", choice.message.tool_calls[0].function.arguments)
    ]


def test_a_stop_string_cuts_a_constrained_answer(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        response_format=_schema_format({"enum": ["alpha,beta"]}), stop=[","], n=2, max_tokens=20
    )
    out = _chat(client, **request)
    assert [(c.message.content, c.finish_reason) for c in out.choices] == [('"alpha', "stop")] * 2
    contents, finishes = ["", ""], [None, None]
    for chunk in _chat(client, **request, stream=True):
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert (contents, finishes) == (['"alpha'] * 2, ["stop"] * 2)
    completion = client.completions.create(
        model=MODEL,
        prompt="Greek letters:",
        max_tokens=20,
        stop=[","],
        extra_body={"response_format": _schema_format({"enum": ["alpha,beta"]})},
    )
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ('"alpha', "stop")


def test_max_tokens_inside_a_grammar_ends_with_length(client: openai.OpenAI) -> None:
    word = "abcdefghijklmnopqrstuvwxyz" * 3  # far longer than 3 tokens of the tiny tokenizer
    request: dict[str, Any] = dict(
        response_format=_schema_format({"enum": [word]}), temperature=1.0, seed=3, max_tokens=3
    )
    out = _chat(client, **request)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert text and f'"{word}"'.startswith(text) and len(text) < len(word)
    assert _streamed(client, **request) == (text, [], "length")
    # a forced call cut short is no call: its text comes back as content
    cut = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1, max_tokens=5)
    choice = cut.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    assert choice.message.content and '{"name": "clock"'.startswith(choice.message.content)


def test_the_clients_parse_helpers_get_their_pydantic_models(client: openai.OpenAI) -> None:
    """``chat.completions.parse`` with a pydantic ``response_format`` and pydantic tools (their
    schemas refer to their own ``$defs``), as the client's users write them."""
    placed = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Place, temperature=1.0, seed=5, max_tokens=100
    )
    assert placed.choices[0].finish_reason == "stop"
    assert isinstance(placed.choices[0].message.parsed, Place)
    forecast = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice={"type": "function", "function": {"name": "Forecast"}},
        temperature=1.0,
        seed=5,
        max_tokens=150,
    )
    choice = forecast.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
