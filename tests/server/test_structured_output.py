"""``response_format`` through the official `openai` client against a real server running
SmolLM2 with n-gram speculative decoding on: every answer is valid under its schema
(`jsonschema`), streaming or not, for each of n choices; streaming equals non-streaming; drafts
are verified under the grammar; an aborted constrained stream leaves no grammar state and no
KV block behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from baton_support.wait import wait_for
from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model]
MODEL = "smollm2"

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLORS: dict[str, Any] = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue", "yellow"]},
    "minItems": 1,
    "maxItems": 3,
}
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "maxLength": 12},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}
ASKS = {
    "person": ("Describe a famous scientist as JSON with a name and an age.", PERSON),
    "colors": ("List the colors of a traffic light as a JSON array.", COLORS),
    "city": ("Give the capital of France as JSON: city, country, and whether it is a capital.", CITY),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log: Path = tmp_path_factory.mktemp("smollm2-structured") / "server.log"
    proc = ServerProcess(
        "builtin:smollm2-135m-instruct",
        "--served-model-name", MODEL,
        "--num-kv-blocks", "256",
        "--max-model-len", "1024",
        "--dtype", "float32",
        "--speculative", "ngram", "--num-speculative-tokens", "3",
        log_path=log,
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("ask", sorted(ASKS))
def test_every_choice_is_valid_and_streaming_gives_the_same_answers(client: openai.OpenAI, ask: str) -> None:
    text, schema = ASKS[ask]
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=_messages(text),
        response_format=_response_format(schema),
        n=2,
        temperature=0.7,
        seed=7,
        max_tokens=80,
    )
    full = client.chat.completions.create(**request)
    answers = [choice.message.content for choice in full.choices]
    for choice in full.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = ["", ""]
    finish: list[str | None] = [None, None]
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert streamed == answers and finish == ["stop", "stop"]


def test_json_object_mode_and_drafts_verified_under_the_grammar(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    before = server.stats()
    out = client.chat.completions.create(
        model=MODEL,
        messages=_messages("Reply with a JSON object with the keys 'a' and 'b' set to 1 and 2."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    content = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and content is not None
    assert isinstance(json.loads(content), dict)
    after = server.wait_idle()
    # JSON repeats itself (quotes, separators): n-gram drafts were proposed and verified
    assert after["spec_num_drafts"] > before["spec_num_drafts"]
    assert after["num_grammar_requests"] == 0


def test_completions_take_a_response_format_too(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": _response_format(PERSON)},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_an_aborted_constrained_stream_leaves_nothing_behind(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": _messages("Write a long story."),
        # at least 400 characters: still running when the client goes away
        "response_format": _response_format({"type": "string", "minLength": 400}),
        "max_tokens": 500,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped line iterator closes the connection
        for line in lines:
            choices = json.loads(line[len("data: ") :])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["delta"].get("content"):
                break  # a token of the answer arrived
        assert server.stats()["num_grammar_requests"] == 1

    def freed() -> bool:  # the connection is closed: the server aborts the request
        stats = server.stats()
        return bool(stats["num_grammar_requests"] == 0 and stats["num_used_kv_blocks"] == 0)

    wait_for(freed, timeout=60, message="the aborted request's grammar and KV blocks to be freed")


@pytest.mark.parametrize(
    ("response_format", "param", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
         "response_format.json_schema.schema", "Invalid type: objectx"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
         "required non-empty string"),
        ({"type": "yaml"}, "response_format.type", "'yaml' is not one of"),
    ],
)  # fmt: skip
def test_a_response_format_that_cannot_be_enforced_is_refused_by_name(
    server: ServerProcess, response_format: dict[str, Any], param: str, message: str
) -> None:
    for path, extra in (
        ("/v1/chat/completions", {"messages": _messages("hi")}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        body = {"model": MODEL, "max_tokens": 2, "response_format": response_format, **extra}
        response = server.http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], (path, error)
