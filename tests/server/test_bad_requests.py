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
    ("chat-missing-content", "/v1/chat/completions", _chat(messages=[{"role": "user"}]), 400, "messages",
     "required for role 'user'"),
    ("chat-top-logprobs-range", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", "less than or equal to 20"),
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions", _chat(top_logprobs=3), 400, "top_logprobs",
     "requires logprobs"),
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
