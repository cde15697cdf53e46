"""Malformed and out-of-range requests: each gets a 4xx with an OpenAI-shaped error naming the
problem, the server keeps serving, and no KV block stays in use."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.server_process import ServerProcess

MODEL = "tiny-chat"
GOOD = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _c(**over: Any) -> dict[str, Any]:
    return {**GOOD, **over}


def _chat(**over: Any) -> dict[str, Any]:
    return {**GOOD_CHAT, **over}


def _raw(field: str, literal: str) -> bytes:
    """A completion body whose `field` is a bare JSON-extension literal (Infinity, NaN)."""
    return b'{"model": "tiny-chat", "prompt": "hi", "%s": %s}' % (field.encode(), literal.encode())


def _schema(schema: Any) -> dict[str, Any]:
    """A ``response_format`` asking for JSON under `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


SCHEMA_PARAM = "response_format.json_schema.schema"
INFINITE_SCHEMA = (
    b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "response_format": '
    b'{"type": "json_schema", "json_schema": {"name": "a", '
    b'"schema": {"type": "number", "maximum": Infinity}}}}'
)


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (case id, path, body: dict or raw bytes, status, param, text the message must contain)
CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    ("bad-json", "/v1/completions", b'{"model": "tiny-chat", "prompt": ', 400, None, "not valid JSON"),
    ("not-an-object", "/v1/completions", b"[1, 2, 3]", 400, None, "must be a JSON object"),
    ("invalid-utf8", "/v1/completions", b'{"model": "tiny-chat", "prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("lone-surrogate", "/v1/completions", b'{"model": "tiny-chat", "prompt": "a\\ud800b"}', 400, "prompt",
     "lone surrogate"),
    ("missing-model", "/v1/completions", _without(GOOD, "model"), 400, "model", "required"),
    ("missing-prompt", "/v1/completions", _without(GOOD, "prompt"), 400, "prompt", "required"),
    ("max-tokens-string", "/v1/completions", _c(max_tokens="10"), 400, "max_tokens", "valid integer"),
    ("max-tokens-zero", "/v1/completions", _c(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-negative", "/v1/completions", _c(max_tokens=-5), 400, "max_tokens", "greater than or equal"),
    ("temperature-negative", "/v1/completions", _c(temperature=-0.5), 400, "temperature", "greater than"),
    ("top-p-above-one", "/v1/completions", _c(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("n-beyond-limit", "/v1/completions", _c(n=100), 400, "n", "less than or equal to 16"),
    ("huge-stop-list", "/v1/completions", _c(stop=[f"s{i}" for i in range(100)]), 400, "stop",
     "at most 16 stop strings"),
    ("empty-stop-string", "/v1/completions", _c(stop=["ok", ""]), 400, "stop", "must not be empty"),
    ("unknown-model", "/v1/completions", _c(model="gpt-17"), 404, "model", "'gpt-17' does not exist"),
    ("prompt-too-long", "/v1/completions", _c(prompt=[5] * 300), 400, "prompt", "max_model_len is 256"),
    ("prompt-plus-max-tokens", "/v1/completions", _c(prompt=[5] * 200, max_tokens=100), 400, "max_tokens",
     "exceeds max_model_len"),
    ("token-id-out-of-range", "/v1/completions", _c(prompt=[1, 2, 99999]), 400, "prompt", "out of range"),
    ("prompt-wrong-type", "/v1/completions", _c(prompt={"text": "hi"}), 400, "prompt", "prompt"),
    ("logprobs-too-many", "/v1/completions", _c(logprobs=10), 400, "logprobs", "less than or equal to 5"),
    ("stream-wrong-type", "/v1/completions", _c(stream="yes"), 400, "stream", "valid boolean"),
    ("seed-negative", "/v1/completions", _c(seed=-1), 400, "seed", "greater than or equal to 0"),
    ("presence-penalty", "/v1/completions", _c(presence_penalty=1.0), 400, "presence_penalty", "only 0"),
    ("echo", "/v1/completions", _c(echo=True), 400, "echo", "not supported"),
    ("chat-empty-messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages", "at least 1"),
    ("chat-messages-string", "/v1/chat/completions", _chat(messages="hi"), 400, "messages", "valid list"),
    ("chat-unknown-role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("chat-missing-content", "/v1/chat/completions", _chat(messages=[{"role": "user"}]), 400,
     "messages[0].content",
     "required for role 'user'"),
    ("chat-top-logprobs-range", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", "less than or equal to 20"),
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions", _chat(top_logprobs=3), 400, "top_logprobs",
     "requires logprobs"),
    # numbers the engine cannot represent (top_k is an int32 column of the batch)
    ("top-k-int32-overflow", "/v1/completions", _c(top_k=2**31), 400, "top_k",
     "less than or equal to 2147483647"),
    ("top-k-huge", "/v1/completions", _c(top_k=10**30), 400, "top_k", "less than or equal to 2147483647"),
    ("max-tokens-int32-overflow", "/v1/completions", _c(max_tokens=2**31), 400, "max_tokens",
     "less than or equal to 2147483647"),
    ("chat-max-completion-tokens-huge", "/v1/chat/completions", _chat(max_completion_tokens=2**63), 400,
     "max_completion_tokens", "less than or equal to 2147483647"),
    ("seed-2-63", "/v1/completions", _c(seed=2**63), 400, "seed", "less than 9223372036854775808"),
    ("temperature-above-two", "/v1/completions", _c(temperature=2.5), 400, "temperature",
     "less than or equal to 2"),
    ("temperature-infinity", "/v1/completions", _raw("temperature", "Infinity"),
     400, "temperature", "finite number"),
    ("temperature-nan", "/v1/completions", _raw("temperature", "NaN"), 400,
     "temperature", "finite number"),
    ("top-p-nan", "/v1/completions", _raw("top_p", "NaN"), 400, "top_p",
     "finite number"),
    ("timeout-infinity", "/v1/completions", _raw("timeout", "Infinity"), 400,
     "timeout", "finite number"),
    ("token-id-huge", "/v1/completions", _c(prompt=[1, 2**64]), 400, "prompt", "out of range"),
    ("token-id-negative", "/v1/completions", _c(prompt=[1, -1]), 400, "prompt", "out of range"),
    # nesting that would exhaust the decoder's recursion, and nesting under the limit but too deep
    ("nested-100000", "/v1/completions", b"[" * 100_000, 400, None,
     "request body has 100000 '[' and '{' characters; at most 65536"),
    ("nested-5000", "/v1/completions", b"[" * 5000, 400, None, "nested deeper than 128 levels"),
    ("nested-object-5000", "/v1/completions", b'{"a": ' * 5000, 400, None, "nested deeper than 128"),
    ("tiny-containers", "/v1/completions", _c(prompt=[[1]] * 70_000), 400, None, "at most 65536"),
    ("nested-field-200", "/v1/completions", _c(metadata=json.loads("[" * 200 + "]" * 200)), 400, None,
     "nested deeper than 128 levels"),
    # messages: the field named exactly; images refused as such
    ("chat-null-content", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0].content", "required for role 'user'"),
    ("chat-second-null-content", "/v1/chat/completions",
     _chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]), 400,
     "messages[1].content", "required for role 'user'"),
    ("chat-image-part", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400,
     "messages[0].content[1]", "images are not supported"),
    ("chat-audio-part", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), 400,
     "messages[0].content[0]", "'input_audio' parts are not supported"),
    ("chat-unknown-part", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "hologram"}]}]), 400, "messages[0].content[0].type", "unknown content part type 'hologram'"),
    ("chat-text-part-without-text", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text"}]}]), 400, "messages[0].content[0].text", "required"),
    # OpenAI fields that change the answer are refused by name, never ignored
    ("chat-functions", "/v1/chat/completions", _chat(functions=[{"name": "f"}]), 400, "functions",
     "not supported"),
    ("chat-modalities-audio", "/v1/chat/completions", _chat(modalities=["text", "audio"]), 400, "modalities",
     "only ['text']"),
    # numbers Python's JSON decoder refuses to convert
    ("integer-5000-digits", "/v1/completions",
     b'{"model": "tiny-chat", "prompt": "hi", "seed": %s}' % (b"7" * 5000), 400, None,
     "request body has an integer of more than 4300 digits"),
    # schemas (response_format, tool parameters) the grammar compiler cannot enforce, named exactly
    ("schema-unsatisfiable", "/v1/chat/completions",
     _chat(response_format=_schema({"type": "integer", "minimum": 5, "maximum": 1})), 400, SCHEMA_PARAM,
     "cannot be enforced: Unsatisfiable schema: minimum (5) is greater than maximum (1)"),
    ("schema-unimplemented-keyword", "/v1/chat/completions",
     _chat(response_format=_schema({"not": {"type": "string"}})), 400, SCHEMA_PARAM,
     'cannot be enforced: Unimplemented keys: ["not"]'),
    ("schema-bad-regex", "/v1/completions", _c(response_format=_schema({"type": "string", "pattern": "(a"})),
     400, SCHEMA_PARAM, "regex parse error"),
    ("schema-dangling-ref", "/v1/completions", _c(response_format=_schema({"$ref": "#/$defs/nope"})), 400,
     SCHEMA_PARAM, "Pointer '/$defs/nope' does not exist"),
    ("schema-length-beyond-64-bits", "/v1/chat/completions",
     _chat(response_format=_schema({"type": "string", "maxLength": 2**64})), 400, SCHEMA_PARAM,
     "Expected positive integer for 'maxLength'"),
    ("schema-infinity", "/v1/chat/completions", INFINITE_SCHEMA, 400, SCHEMA_PARAM,
     "cannot be enforced: numbers must be finite"),
    ("schema-not-an-object", "/v1/chat/completions", _chat(response_format=_schema(True)), 400, SCHEMA_PARAM,
     "must be a JSON schema object"),
    ("schema-too-big", "/v1/chat/completions",
     _chat(response_format=_schema({"enum": [f"value-{i:06d}" for i in range(100_000)]})), 400, SCHEMA_PARAM,
     "too big"),
    ("json-schema-missing", "/v1/chat/completions", _chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", "required object"),
    ("schema-strict-not-bool", "/v1/chat/completions", _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}), 400,
     "response_format.json_schema.strict", "must be a boolean"),
    ("tool-parameters-beyond-64-bits", "/v1/chat/completions",
     _chat(tools=[_tool({"type": "object", "properties": {"a": {"type": "array", "maxItems": 2**64}}})]),
     400, "tools[0].function.parameters",
     "Expected positive integer for 'maxItems'"),
    ("tool-parameters-infinity", "/v1/chat/completions",
     _chat(tools=[_tool({"type": "object"}), _tool({"type": "number", "minimum": float("-inf")})]), 400,
     "tools[1].function.parameters", "numbers must be finite"),
    ("tool-not-a-function", "/v1/chat/completions", _chat(tools=[{"type": "retrieval"}]), 400,
     "tools[0].type", "only tools of type 'function'"),
    ("tool-name-twice", "/v1/chat/completions", _chat(tools=[_tool({}), _tool({})]), 400, "tools",
     "function name 'f' is offered twice"),
    # a client's long value is quoted back cut short
    ("unknown-long-model", "/v1/completions", _c(model="m" * 100_000), 404, "model", "(100000 characters)"),
]  # fmt: skip


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_leak_nothing(tiny_server: ServerProcess) -> None:
    assert len(CASES) >= 15
    failures = []
    for case, path, body, status, param, text in CASES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = tiny_server.http.post(
            path, content=content, headers={"content-type": "application/json", "X-Request-Id": f"bad-{case}"}
        )
        error = (
            response.json().get("error")
            if response.headers.get("content-type") == "application/json"
            else None
        )
        if (
            response.status_code != status
            or not isinstance(error, dict)
            or set(error) != {"message", "type", "param", "code"}
            or error["param"] != param
            or text not in error["message"]
            or response.headers.get("x-request-id") != f"bad-{case}"
        ):
            failures.append(f"{case}: {response.status_code} {response.text[:300]}")
    assert failures == []
    # still serving, and nothing leaked
    ok = tiny_server.http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] >= 1
    ok_chat = tiny_server.http.post("/v1/chat/completions", json=GOOD_CHAT)
    assert ok_chat.status_code == 200
    stats = tiny_server.wait_idle()
    assert stats["num_used_kv_blocks"] == 0


@pytest.mark.slow
def test_values_at_their_limits_are_served(tiny_server: ServerProcess) -> None:
    """The largest value each bounded field accepts runs through the engine (and decodes the same
    tokens as the equivalent everyday value where one exists)."""
    greedy = {**GOOD, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    plain = tiny_server.http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    widest_top_k = tiny_server.http.post("/v1/completions", json={**greedy, "top_k": 2**31 - 1})
    assert widest_top_k.status_code == 200, widest_top_k.text
    assert widest_top_k.json()["choices"][0]["text"] == plain  # k >= vocab keeps every token
    seeded = {**GOOD, "max_tokens": 6, "ignore_eos": True, "temperature": 2.0, "seed": 2**63 - 1}
    first = tiny_server.http.post("/v1/completions", json={**seeded, "top_k": 2**31 - 1})
    again = tiny_server.http.post("/v1/completions", json={**seeded, "top_k": -1})
    assert first.status_code == again.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    edge = {**GOOD, "n": 16, "logprobs": 5, "max_tokens": 2, "top_p": 1.0, "temperature": 2.0}
    many = tiny_server.http.post("/v1/completions", json=edge)
    assert many.status_code == 200, many.text
    assert [c["index"] for c in many.json()["choices"]] == list(range(16))
    chat = tiny_server.http.post(
        "/v1/chat/completions", json={**GOOD_CHAT, "logprobs": True, "top_logprobs": 20, "max_tokens": 2}
    )
    assert chat.status_code == 200, chat.text
    assert [len(t["top_logprobs"]) for t in chat.json()["choices"][0]["logprobs"]["content"]] == [20, 20]
    assert tiny_server.wait_idle()["num_used_kv_blocks"] == 0


@pytest.mark.slow
def test_prompt_tokens_count_each_prompt_once_whatever_n(tiny_server: ServerProcess) -> None:
    ids = {**GOOD, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    for n in (1, 3):
        usage = tiny_server.http.post("/v1/completions", json={**ids, "n": n}).json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            3,
            2 * n,
            3 + 2 * n,
        )
    two = {**ids, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 1}
    usage = tiny_server.http.post("/v1/completions", json=two).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3 + 2, 4)
    chat_one = tiny_server.http.post("/v1/chat/completions", json=GOOD_CHAT).json()["usage"]
    chat_four = tiny_server.http.post("/v1/chat/completions", json={**GOOD_CHAT, "n": 4}).json()["usage"]
    assert chat_four["prompt_tokens"] == chat_one["prompt_tokens"] > 0


def _error(response: Any) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.slow
def test_unknown_paths_and_methods_get_openai_errors(tiny_server: ServerProcess) -> None:
    missing = tiny_server.http.get("/v1/engines")
    assert missing.status_code == 404
    assert _error(missing) == {
        "message": "no such endpoint: GET '/v1/engines'",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    wrong = tiny_server.http.get("/v1/completions")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert _error(wrong) == {
        "message": "method not allowed: GET '/v1/completions' (allowed: POST)",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }
    assert _error(tiny_server.http.delete("/v1/models"))["code"] == "method_not_allowed"


@pytest.mark.slow
def test_body_over_the_limit_gets_413_before_it_is_read(tiny_server: ServerProcess) -> None:
    limit = 8 * 1024 * 1024  # EngineConfig.max_request_body_bytes' default
    body = json.dumps({**GOOD, "prompt": "x" * (10 * 1024 * 1024)}).encode()
    response = tiny_server.http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert _error(response) == {
        "message": f"request body is {len(body)} bytes; this server accepts at most {limit} "
        "(--max-request-body-bytes)",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }

    def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    streamed = tiny_server.http.post(
        "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert _error(streamed)["message"] == (
        f"request body is over {limit} bytes; this server accepts at most {limit} (--max-request-body-bytes)"
    )
    at_limit = {**GOOD, "prompt": "x"}
    padding = limit - len(json.dumps({**at_limit, "user": ""}).encode())
    exact = json.dumps({**at_limit, "user": "u" * padding}).encode()
    assert len(exact) == limit
    served = tiny_server.http.post(
        "/v1/completions", content=exact, headers={"content-type": "application/json"}
    )
    assert served.status_code == 200, served.text
    assert tiny_server.http.post("/v1/completions", json=GOOD).status_code == 200
