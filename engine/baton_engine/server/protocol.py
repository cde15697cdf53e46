"""OpenAI request bodies: parsing and validation into errors that name the offending field.

Models are strict (no string-to-number coercion) and ignore unknown fields, as OpenAI's own
API does for fields it does not know. Semantic checks that pydantic cannot express (limits,
unsupported features) raise `APIError` with ``param`` set.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baton_engine.core.sampling_params import MAX_LOGPROBS, MAX_N
from baton_engine.server.errors import APIError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def decode_body(raw: bytes) -> Any:
    """The JSON object of a request body, or a 400 naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8") from exc
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _check_unicode(body, "")
    return body


def _check_unicode(value: Any, path: str) -> None:
    """JSON escapes can smuggle lone surrogates, which are not text; reject them by name."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad_request(
                f"{path or 'body'}: contains an invalid Unicode code point (lone surrogate)",
                param=path or None,
                code="invalid_utf8",
            ) from exc
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")


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
            shown = (
                json.dumps(got)[:80]
                if isinstance(got, int | float | str | bool | None)
                else type(got).__name__
            )
            message = f"{param}: {first['msg']} (got {shown})"
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
        if isinstance(request.prompt, list) and not request.prompt:
            raise bad_request("prompt: must not be empty", param="prompt")
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")


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
            content = "".join(part.text for part in content)
        if content is None:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].content: required for role {message.role!r}", "messages")
            content = ""
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
