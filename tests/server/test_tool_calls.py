"""Tool calls parsed from answers, whole and streamed (split at every character boundary)."""

from __future__ import annotations

import json

import pytest

from baton_engine.server.tool_calls import ParsedOutput, StreamingToolParser, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {}}'


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 3})]),
        (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
         "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
        ("No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        (f"<tool_call>\n{WEATHER}\n", f"<tool_call>\n{WEATHER}\n", []),  # never closed
        (f"<tool_call>\n{WEATHER}\n</tool_call> and more",
         f"<tool_call>\n{WEATHER}\n</tool_call> and more", []),
    ],
)  # fmt: skip
def test_hermes(text: str, content: str | None, calls: list[tuple[str, dict[str, object]]]) -> None:
    parsed = parse_tool_calls(text, "hermes")
    assert (parsed.content, _calls(parsed)) == (content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1]}}', None,
         [("a", {}), ("b", {"k": [1]})]),
        ("  The answer is 42.", "  The answer is 42.", []),
        ('{"name": "a", "parameters": {}} trailing', '{"name": "a", "parameters": {}} trailing', []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
)  # fmt: skip
def test_llama3_json(text: str, content: str | None, calls: list[tuple[str, dict[str, object]]]) -> None:
    parsed = parse_tool_calls(text, "llama3_json")
    assert (parsed.content, _calls(parsed)) == (content, calls)


def _stream(text: str, fmt: str, pieces: list[int]) -> tuple[str, list[tuple[int, str, dict[str, object]]]]:
    parser = StreamingToolParser(fmt)  # type: ignore[arg-type]
    events = []
    start = 0
    for end in [*pieces, len(text)]:
        events += parser.feed(text[start:end])
        start = end
    events += parser.finish()
    content = "".join(e.content for e in events if e.content is not None)
    calls = [(e.index, e.tool_call.name, json.loads(e.tool_call.arguments)) for e in events if e.tool_call]
    return content, calls


HERMES_ANSWERS = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    "Plain text with a < sign and <tool and <tool_cal but no call.",
    f"<tool_call>\n{WEATHER}\n",
]
LLAMA_ANSWERS = [
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1]}}',
    "  The answer is 42.",
    "<|python but not a tag",
]


@pytest.mark.parametrize(
    ("fmt", "text"), [*(("hermes", t) for t in HERMES_ANSWERS), *(("llama3_json", t) for t in LLAMA_ANSWERS)]
)
def test_streaming_matches_the_whole_parse_at_every_split(fmt: str, text: str) -> None:
    whole = parse_tool_calls(text, fmt)  # type: ignore[arg-type]
    expected_calls = [(i, name, args) for i, (name, args) in enumerate(_calls(whole))]
    expected_content = (whole.content or "") if whole.tool_calls else text
    for split in range(len(text) + 1):
        content, calls = _stream(text, fmt, [split])
        assert calls == expected_calls, split
        assert content.rstrip() == expected_content.rstrip(), split
    one_char_at_a_time = _stream(text, fmt, list(range(1, len(text))))
    assert one_char_at_a_time[1] == expected_calls


def test_streamed_content_is_not_held_back_longer_than_a_possible_tag() -> None:
    parser = StreamingToolParser("hermes")
    assert [e.content for e in parser.feed("Hello <to")] == ["Hello "]
    assert [e.content for e in parser.feed("ols are fun")] == ["<tools are fun"]
    assert parser.feed("<tool_call>\n" + WEATHER) == []
    (event,) = parser.feed("\n</tool_call>")
    assert event.tool_call is not None and (event.index, event.tool_call.name) == (0, "get_weather")
    assert event.tool_call.to_dict(0)["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "days": 3}',
    }
    assert event.tool_call.id.startswith("call_") and len(event.tool_call.id) == 29
