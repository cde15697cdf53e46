"""Tool calls in a model's output: parsed into OpenAI ``tool_calls``, whole or as stream deltas.

Two formats (`baton_engine.structured.grammar.ToolCallFormat`):

- ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks, text before them is the message content;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several separated by ``;``).

A block that is not a valid call stays text, so nothing the model wrote is lost. The streaming
parser emits content as soon as it cannot be the start of a call, and each call once complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from baton_engine.structured.grammar import ToolCallFormat

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's shape)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def _call_from_json(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[k] for k in arguments_keys if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> ParsedOutput:
    """A whole answer's content and calls (no calls: the text is all content)."""
    if fmt == "hermes":
        return _parse_hermes(text)
    return _parse_llama3_json(text)


def _parse_hermes(text: str) -> ParsedOutput:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(HERMES_OPEN):
            return ParsedOutput(text, [])  # text after or between calls: not a clean call list
        end = rest.find(HERMES_CLOSE)
        if end < 0:
            return ParsedOutput(text, [])
        call = _call_from_json(rest[len(HERMES_OPEN) : end].strip(), ("arguments", "parameters"))
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
        rest = rest[end + len(HERMES_CLOSE) :]
    content = text[:start].rstrip()
    return ParsedOutput(content or None, calls)


def _split_json_objects(text: str) -> list[str] | None:
    """``{...}; {...}`` into its objects (None unless the text is exactly that)."""
    decoder = json.JSONDecoder()
    parts: list[str] = []
    position = 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        parts.append(text[position:end])
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return parts
        if text[position] != ";":
            return None
        position += 1


def _parse_llama3_json(text: str) -> ParsedOutput:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    parts = _split_json_objects(body)
    if parts is None:
        return ParsedOutput(text, [])
    calls = [_call_from_json(part, ("parameters", "arguments")) for part in parts]
    if any(call is None for call in calls):
        return ParsedOutput(text, [])
    return ParsedOutput(None, [call for call in calls if call is not None])


@dataclass
class StreamEvent:
    """One piece of a streamed answer: content text, or a complete call (`index` among calls)."""

    content: str | None = None
    tool_call: ToolCall | None = None
    index: int = 0


class StreamingToolParser:
    """Feed text deltas; get content deltas and complete calls back, in order."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self._buffer = ""
        self._in_call = False
        self._decided: bool | None = None  # llama3_json: does the answer start as a call?
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        if self.fmt == "hermes":
            return self._hermes(final=False)
        return self._llama3(final=False)

    def finish(self) -> list[StreamEvent]:
        """The end of the answer: what is still buffered (an unfinished call stays text)."""
        if self.fmt == "hermes":
            return self._hermes(final=True)
        return self._llama3(final=True)

    def _call_event(self, call: ToolCall) -> StreamEvent:
        event = StreamEvent(tool_call=call, index=self._num_calls)
        self._num_calls += 1
        return event

    def _hermes(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buffer:
            if not self._in_call:
                start = self._buffer.find(HERMES_OPEN)
                if start >= 0:
                    before, self._buffer = self._buffer[:start], self._buffer[start:]
                    self._in_call = True
                    if before and not (self._num_calls and not before.strip()):
                        events.append(StreamEvent(content=before))
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, HERMES_OPEN)
                text = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(text) :]
                if text and not (self._num_calls and not text.strip()):
                    events.append(StreamEvent(content=text))
                break
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                if final:
                    events.append(StreamEvent(content=self._buffer))
                    self._buffer = ""
                break
            block = self._buffer[: end + len(HERMES_CLOSE)]
            self._buffer = self._buffer[len(block) :]
            self._in_call = False
            call = _call_from_json(
                block[len(HERMES_OPEN) : -len(HERMES_CLOSE)].strip(), ("arguments", "parameters")
            )
            events.append(self._call_event(call) if call is not None else StreamEvent(content=block))
        return events

    def _llama3(self, final: bool) -> list[StreamEvent]:
        if self._decided is None:
            head = self._buffer.lstrip()
            if not head and not final:
                return []
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._decided = True
            elif PYTHON_TAG.startswith(head) and not final:
                return []  # could still become the tag
            else:
                self._decided = False
        if not self._decided:
            text, self._buffer = self._buffer, ""
            return [StreamEvent(content=text)] if text else []
        if not final:
            return []  # a call is only known complete at the end of the answer
        parsed = _parse_llama3_json(self._buffer)
        text, self._buffer = self._buffer, ""
        if not parsed.tool_calls:
            return [StreamEvent(content=text)] if text else []
        return [self._call_event(call) for call in parsed.tool_calls]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
