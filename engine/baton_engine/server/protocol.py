"""OpenAI request bodies: parsing and validation into errors that name the offending field.

Models are strict (no string-to-number coercion, no NaN or infinity) and ignore unknown fields,
as OpenAI's own API does for fields it does not know; OpenAI fields that would change the answer
and that Baton does not implement are refused by name. Every number is bounded by what the
engine can represent (`baton_engine.core.sampling_params`). Semantic checks that pydantic cannot
express (limits, unsupported features) raise `APIError` with ``param`` set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baton_engine.core.sampling_params import MAX_INT32, MAX_LOGPROBS, MAX_N
from baton_engine.server.errors import APIError, bad_request
from baton_engine.structured.grammar import (
    StructuredOutputError,
    Tool,
    ToolCallFormat,
    parse_tools,
    response_format_grammar,
    tool_call_grammar,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a request body may have (JSON schemas stay far below)."""
MAX_JSON_CONTAINERS = 65536
"""Most arrays and objects a body may hold (a valid request has far fewer: prompts and choices
are capped by ``max_queued_requests``). Decoding millions of tiny containers holds the GIL for
seconds, which would stall every stream and the liveness probe."""
MAX_SHOWN_CHARS = 80
"""How much of a client's value an error message quotes back."""

_IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_OTHER_MEDIA_PART_TYPES = ("input_audio", "audio_url", "video_url", "file", "input_file")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT32)
    """vLLM extension: -1 or 0 disables it."""
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0.0)
    """Baton extension: seconds after which the request is aborted with HTTP 408."""
    kv_transfer_params: dict[str, Any] | None = None
    """P/D: ``{"do_remote_decode": true}`` (prefill leg) or a producer's signed params (decode leg)."""


class CompletionRequest(_Common):
    prompt: Any = Field(...)
    """A string, a list of strings, a list of token ids or a list of token-id lists; checked by
    `prompt_parts` in plain Python (pydantic's union would validate a million-id list against
    every branch, holding the GIL for seconds)."""
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    response_format: dict[str, Any] | None = None
    """vLLM extension on this endpoint: ``json_object`` / ``json_schema`` as for chat."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Strict):
    """One part of a message's content; only ``text`` parts are supported (checked in
    `chat_messages`, so that an image part gets a message saying so)."""

    type: str
    text: str | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: str
    """JSON text, as OpenAI returns it."""


class AssistantToolCall(_Strict):
    """A call an earlier assistant turn made (sent back by the client with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    """role ``tool``: the call this message answers."""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    """Deprecated OpenAI field (superseded by `tools`)."""
    function_call: str | dict[str, Any] | None = None
    """Deprecated OpenAI field (superseded by `tool_choice`)."""
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None


def prompt_parts(prompt: Any) -> tuple[list[str], list[list[int]]]:
    """A completion's prompt as (texts, token-id prompts), exactly one of them non-empty."""
    if isinstance(prompt, str):
        return [prompt], []
    if not isinstance(prompt, list):
        raise _bad_prompt(prompt)
    if not prompt:
        raise bad_request("prompt: must not be empty", param="prompt")
    if all(type(x) is int for x in prompt):
        return [], [prompt]
    if all(type(x) is str for x in prompt):
        return prompt, []
    if all(type(p) is list and all(type(x) is int for x in p) for p in prompt):
        return [], prompt
    raise _bad_prompt(prompt)


def _bad_prompt(prompt: Any) -> APIError:
    return bad_request(
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists "
        f"(got {type(prompt).__name__})",
        param="prompt",
    )


def decode_body(raw: bytes) -> Any:
    """The JSON object of a request body, or a 400 naming what is wrong with it."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:  # counted before decoding: decoding them holds the GIL
        raise bad_request(
            f"request body has {containers} '[' and '{{' characters; at most {MAX_JSON_CONTAINERS} "
            "(arrays and objects; brackets in text count too) are accepted",
            code="invalid_json",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8") from exc
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # the C decoder recurses once per nesting level
        raise _too_deep() from exc
    except ValueError as exc:  # the only other decoding error: an integer too long to convert
        raise bad_request(
            f"request body has an integer of more than {sys.get_int_max_str_digits()} digits",
            code="invalid_json",
        ) from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _check_values(body)
    return body


def _too_deep() -> APIError:
    return bad_request(
        f"request body is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects",
        code="invalid_json",
    )


def _check_values(body: dict[str, Any]) -> None:
    """Walk the decoded body once, iteratively (no recursion to exhaust): refuse nesting deeper
    than `MAX_JSON_DEPTH`, and strings holding lone surrogates (JSON escapes can smuggle them
    in; they are not text), naming the field."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path)
                    stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
            else:
                for i, item in enumerate(value):
                    if isinstance(item, dict | list | str):
                        stack.append((item, f"{path}[{i}]", depth + 1))


def _check_text(value: str, path: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{path or 'body'}: contains an invalid Unicode code point (lone surrogate)",
            param=path or None,
            code="invalid_utf8",
        ) from exc


def shown(value: str) -> str:
    """`value` as an error message quotes it: repr, cut to `MAX_SHOWN_CHARS`."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}...' ({len(value)} characters)"


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "list[str]", "list[int]", "list[list[int]]") or "[" in part:
            continue  # union-branch labels pydantic puts in the location
        else:
            out += f".{part}" if out else part
    return out


def parse(model: type[_Common], body: Any) -> Any:
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first["loc"]))
        kind = first["type"]
        if kind == "missing":
            message = f"{param}: required field is missing"
        else:
            got = first.get("input")
            quoted = (
                json.dumps(got)[:MAX_SHOWN_CHARS]
                if isinstance(got, int | float | str | bool | None)
                else type(got).__name__
            )
            message = f"{param}: {first['msg']} (got {quoted})"
        raise APIError(400, message, param=param or None, code="invalid_value") from exc
    _check_common(request)
    return request


def _check_common(request: _Common) -> None:
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    for i, stop in enumerate(stops):
        if not stop:
            raise bad_request(f"stop[{i}]: must not be empty", param="stop")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"stop[{i}]: longer than {MAX_STOP_STRING_CHARS} characters", param="stop")
    if request.presence_penalty or request.frequency_penalty:
        which = "presence_penalty" if request.presence_penalty else "frequency_penalty"
        raise bad_request(f"{which}: only 0 is supported", param=which)
    if request.logit_bias:
        raise bad_request("logit_bias: not supported", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise bad_request("echo: not supported", param="echo")
        if request.suffix:
            raise bad_request("suffix: not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of: only best_of == n is supported", param="best_of")
        prompt_parts(request.prompt)
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
        _check_unsupported_chat(request)


def _check_unsupported_chat(request: ChatCompletionRequest) -> None:
    """OpenAI fields that would change the answer and that this server does not implement:
    refused by name rather than silently ignored (their neutral values pass). Tools and
    ``tool_choice`` are checked here; their grammar (and ``response_format``'s) is built by
    `request_grammar` once the model's tool-call format is known."""
    try:
        tools = parse_tools(request.tools or [])
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
    forced = forced_tools(request, tools)
    if forced is not None and request.response_format and request.response_format.get("type") != "text":
        raise bad_request(
            "response_format: cannot be combined with tool_choice 'required' or a named function (each "
            "decides the whole answer); send one of them",
            param="response_format",
            code="unsupported",
        )
    for name in ("functions", "function_call", "audio", "prediction"):
        if getattr(request, name) is not None:
            raise bad_request(f"{name}: not supported", param=name)
    if request.modalities is not None and request.modalities != ["text"]:
        raise bad_request(
            f"modalities: only ['text'] is supported, got {request.modalities!r}", param="modalities"
        )


def forced_tools(request: ChatCompletionRequest, tools: list[Tool]) -> list[Tool] | None:
    """The tools the answer must call (`tool_choice` ``required``: any offered one; a named
    function: that one), or None when the model may answer freely (``none``, ``auto``)."""
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request(
                "tool_choice: must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        named = [t for t in tools if t.name == name]
        if not named:
            raise bad_request(
                f"tool_choice.function.name: {shown(name)} is not one of the offered tools",
                param="tool_choice.function.name",
            )
        return named
    if choice != "required":
        raise bad_request(
            f"tool_choice: {shown(choice)} is not one of 'none', 'auto', 'required' or a named function",
            param="tool_choice",
        )
    if not tools:
        raise bad_request("tool_choice: requires tools", param="tool_choice")
    return tools


@dataclass(frozen=True)
class RequestGrammar:
    """The grammar a request's answer must follow, and the field it comes from."""

    grammar: str
    param: str
    """``response_format`` or ``tool_choice`` (named in errors about the grammar)."""


def request_grammar(
    request: CompletionRequest | ChatCompletionRequest, tool_format: ToolCallFormat | None = None
) -> RequestGrammar | None:
    """The grammar of `request`'s ``response_format``, or of its forced tool calls in the
    model's `tool_format`; None for free text. A field that cannot be enforced is a 400
    naming it."""
    try:
        if isinstance(request, ChatCompletionRequest):
            forced = forced_tools(request, parse_tools(request.tools or []))
            if forced is not None:
                if tool_format is None:
                    raise bad_request(
                        "tools: this model's chat template renders no tools (no tool-call format known "
                        "for it)",
                        param="tools",
                    )
                # A named function is called once; 'required' may call several unless
                # parallel_tool_calls is false.
                parallel = request.tool_choice == "required" and request.parallel_tool_calls is not False
                grammar = tool_call_grammar(forced, tool_format, parallel=parallel)
                return RequestGrammar(grammar, "tool_choice")
        built = response_format_grammar(request.response_format)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
    return None if built is None else RequestGrammar(built, "response_format")


def stop_list(request: _Common) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (content parts joined into text)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            parts = enumerate(content)
            content = "".join(_part_text(part, f"messages[{i}].content[{j}]") for j, part in parts)
        if content is None:
            if message.role != "assistant":
                raise bad_request(
                    f"messages[{i}].content: required for role {message.role!r}", f"messages[{i}].content"
                )
            content = ""
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_tool_call(call: AssistantToolCall) -> dict[str, Any]:
    """A past call as chat templates read it: arguments as an object where they parse (HF's
    convention; templates ``tojson`` them), else the text as sent."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function, **function}


def _part_text(part: ContentPart, where: str) -> str:
    if part.type == "text":
        if part.text is None:
            raise bad_request(f"{where}.text: required for a part of type 'text'", f"{where}.text")
        return part.text
    if part.type in _IMAGE_PART_TYPES:
        raise bad_request(
            f"{where}: images are not supported: this server serves a text-only model (send text parts)",
            where,
            code="unsupported_content",
        )
    if part.type in _OTHER_MEDIA_PART_TYPES:
        raise bad_request(
            f"{where}: {part.type!r} parts are not supported: this server serves a text-only model",
            where,
            code="unsupported_content",
        )
    raise bad_request(
        f"{where}.type: unknown content part type {shown(part.type)} (supported: 'text')", f"{where}.type"
    )
