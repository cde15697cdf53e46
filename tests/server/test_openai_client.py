"""The official `openai` client against a real server running SmolLM2 (real text)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log: Path = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    proc = ServerProcess(
        "builtin:smollm2-135m-instruct",
        "--served-model-name", "smollm2",
        "--num-kv-blocks", "512",
        "--max-model-len", "1024",
        log_path=log,
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_completion_greedy_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == 5

    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_stop_string_cuts_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert "." in full.choices[0].text
    expected = full.choices[0].text.split(".")[0]
    stopped = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=["."]
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=["."], stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3
        assert lp <= 0.0
        # greedy: the sampled token is the most likely one
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)
        assert top[token] == pytest.approx(lp, abs=1e-4)


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    answer = full.choices[0].message.content
    assert answer is not None and "Paris" in answer
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    assert chunks[-1].usage is not None and full.usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs and out.choices[0].logprobs.content
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert item.bytes == list(item.token.encode())


def test_seeds_reproduce_and_differ(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model="smollm2", prompt="Write a story:", max_tokens=16, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first
    two = client.completions.create(
        model="smollm2", prompt="Write a story:", max_tokens=16, temperature=1.0, seed=1234, n=2
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == first
    assert two.choices[1].text != first


def test_request_id_is_returned(server: ServerProcess) -> None:
    response = server.http.post(
        "/v1/completions",
        json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 1},
        headers={"X-Request-Id": "my-request-42"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-request-42"
    assert response.json()["id"] == "my-request-42"
    assert "request my-request-42" in server.log_text()
    generated = server.http.post(
        "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 1}
    )
    assert generated.headers["x-request-id"].startswith("cmpl-")


def test_chat_logprobs_carry_each_tokens_real_bytes(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Repeat exactly: " + "🎉" * 10}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    content = out.choices[0].logprobs and out.choices[0].logprobs.content
    assert content is not None and out.choices[0].message.content is not None
    rebuilt = b"".join(bytes(item.bytes or []) for item in content)
    assert rebuilt.decode("utf-8", "replace") == out.choices[0].message.content
    assert "🎉" in out.choices[0].message.content  # the answer repeats it: tokens split its bytes
    split = [item for item in content if item.token == "\ufffd"]
    assert split and all(item.bytes != [239, 191, 189] for item in split)
