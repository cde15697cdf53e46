"""Tools through the official client against a tiny random Qwen3 with a Qwen3-style (Hermes)
template: the template renders the tools exactly as transformers renders them, answers without
a call stay content, ``tool_choice`` ``required`` and a named function make even random weights
call a tool with arguments valid under its schema (parsed into ``tool_calls``, whole and as
streaming deltas), and what cannot be enforced is refused naming the field."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from baton_support.tiny_models import CHAT
from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.server_process import ServerProcess
from tests.server.tool_fixtures import CLOCK, SCHEMAS, described
from tests.server.tool_fixtures import LOOKUP as UNDESCRIBED_LOOKUP

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3"
TEMPLATE = (Path(__file__).parent / "data" / "qwen3_tools.jinja").read_text()
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
LOOKUP = described(UNDESCRIBED_LOOKUP, "Look a word up.")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3") / MODEL
    CHAT.replace(family="qwen3").save(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("qwen3-server") / "server.log"
    proc = ServerProcess(str(qwen3_dir), *TINY_SERVER_ARGS, "--max-model-len", "1024", log_path=log)
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _reference_prompt_tokens(qwen3_dir: Path, messages: list[dict[str, Any]], tools: list[Any] | None) -> int:
    """transformers' own rendering of the template, tokenized."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_dir / "tokenizer.json"))
    tokenizer.chat_template = TEMPLATE
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_tools_are_rendered_by_the_template(client: openai.OpenAI, qwen3_dir: Path) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    with_tools = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=4,
        temperature=0,
    )
    assert plain.usage is not None and with_tools.usage is not None
    assert plain.usage.prompt_tokens == _reference_prompt_tokens(qwen3_dir, MESSAGES, None)
    assert with_tools.usage.prompt_tokens == _reference_prompt_tokens(qwen3_dir, MESSAGES, [WEATHER])
    # random weights never spell a call: the answer stays content, nothing is lost
    message = with_tools.choices[0].message
    assert message.tool_calls is None and message.content is not None
    assert with_tools.choices[0].finish_reason in ("length", "stop")


def test_a_conversation_with_calls_and_results_renders(client: openai.OpenAI, qwen3_dir: Path) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=2)  # type: ignore[arg-type, list-item]
    parsed_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    reference = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [parsed_call]}, messages[2]]
    assert out.usage is not None
    assert out.usage.prompt_tokens == _reference_prompt_tokens(qwen3_dir, reference, [WEATHER])


def test_streamed_answer_without_a_call_is_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type, list-item]
    )
    chunks = list(stream)
    assert all(not c.choices or c.choices[0].delta.tool_calls is None for c in chunks)
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0
    )  # type: ignore[arg-type, list-item]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )


def _forced(client: openai.OpenAI, tool_choice: Any, seed: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[LOOKUP, CLOCK],  # type: ignore[list-item]
        tool_choice=tool_choice,
        temperature=1.0,
        seed=seed,
        max_tokens=150,
        **extra,
    )


def _assert_valid_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS if name is None else call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_makes_the_model_call_a_tool(client: openai.OpenAI, seed: int) -> None:
    out = _forced(client, "required", seed, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls is not None
    assert len(choice.message.tool_calls) == 1
    _assert_valid_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in (4, 5):
        out = _forced(client, {"type": "function", "function": {"name": "clock"}}, seed)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1
        _assert_valid_call(calls[0], "clock")


def test_streamed_calls_are_the_whole_answers_calls(client: openai.OpenAI) -> None:
    whole = _forced(client, "required", 6, n=2, parallel_tool_calls=False)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[LOOKUP, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=6,
        max_tokens=150,
        n=2,
        stream=True,
    )
    calls: dict[int, list[Any]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index].extend(choice.delta.tool_calls or [])
            assert not choice.delta.content
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for choice in whole.choices:
        (streamed,) = calls[choice.index]  # each call arrives whole, in one delta
        assert choice.message.tool_calls is not None
        (expected,) = choice.message.tool_calls
        assert streamed.index == 0 and streamed.id.startswith("call_")
        assert streamed.function is not None
        assert (streamed.function.name, streamed.function.arguments) == (
            expected.function.name,
            expected.function.arguments,
        )
        _assert_valid_call(expected)


@pytest.mark.parametrize(
    ("extra", "param", "code", "text"),
    [
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "unsupported", "cannot be combined with tool_choice 'required'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice.function.name", None, "'get_time' is not one of the offered tools"),
        ({"tool_choice": "required"}, "tool_choice", None, "requires tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None, "'sometimes' is not one of"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
         "tools[0].function.parameters", None, "cannot be enforced"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema", None, "Invalid type: objectx"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_refused_by_name(
    server: ServerProcess, extra: dict[str, Any], param: str, code: str | None, text: str
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert text in error["message"]


def test_tools_for_a_template_without_tools_are_refused(tiny_server: ServerProcess) -> None:
    body = {"model": "tiny-chat", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2}
    response = tiny_server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert "renders no tools" in response.json()["error"]["message"]
