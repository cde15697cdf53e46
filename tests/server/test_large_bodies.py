"""Bodies of many megabytes: refused or served without stalling the event loop (the liveness
probe keeps answering within its timeout) and without the front end keeping their memory."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "tiny-chat"
LIVENESS_TIMEOUT_S = 5.0
"""The engine pods' liveness probe timeout (the operator's builders: ``timeout=5``)."""
TEN_MB = 10 * 1024 * 1024


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_ten_megabyte_bodies_in_a_row_never_stall_health(
    start_tiny_server: Callable[..., ServerProcess],
) -> None:
    server = start_tiny_server("--max-request-body-bytes", str(4 * TEN_MB))
    # warm up: the first requests allocate the server's steady-state buffers
    for _ in range(2):
        warm = server.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hello world! " * 10, "max_tokens": 1}
        )
        assert warm.status_code == 200, warm.text
    rss_before = _rss_bytes(server.pid)
    text = "Hello world! " * (TEN_MB // 13)
    enum = [f"value-{i:07d}" for i in range(TEN_MB // 17)]  # 17 bytes each as JSON
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
        ("/v1/completions", {"model": MODEL, "prompt": [text, "short"], "max_tokens": 4}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * (TEN_MB // 3), "max_tokens": 4}),
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
        # a schema of 10 MB: compiled (off the event loop) until llguidance's size limit refuses it
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "big", "schema": {"enum": enum}},
                },
            },
        ),
    ]
    results: list[tuple[int, dict[str, Any]]] = []

    def send_all() -> None:
        with httpx.Client(base_url=server.url, timeout=300.0) as client:
            for path, body in bodies:
                content = json.dumps(body).encode()
                assert len(content) >= TEN_MB
                response = client.post(path, content=content, headers={"content-type": "application/json"})
                results.append((response.status_code, response.json()["error"]))

    sender = threading.Thread(target=send_all)
    sender.start()
    health_checks = 0
    with httpx.Client(base_url=server.url, timeout=LIVENESS_TIMEOUT_S) as probe:
        while sender.is_alive():
            assert probe.get("/health").status_code == 200  # raises if it takes longer than the probe allows
            health_checks += 1
    sender.join()
    assert health_checks >= 1
    assert [(status, e["param"], e["code"]) for status, e in results] == [
        (400, "prompt", "context_length_exceeded"),
        (400, "prompt", "context_length_exceeded"),
        (400, "messages", "context_length_exceeded"),
        (400, "prompt", "context_length_exceeded"),
        (400, "prompt", "context_length_exceeded"),
        (400, "response_format.json_schema.schema", None),
    ]
    assert "cannot be enforced: initial lexer configuration (grammar) too big" in results[5][1]["message"]
    assert results[0][1]["message"].startswith(
        f"prompt: {len(text)} characters cannot fit in max_model_len 256"
    )
    assert results[1][1]["message"].startswith(f"prompt[0]: {len(text)} characters cannot fit")
    assert results[3][1]["message"].startswith(f"prompt: {TEN_MB // 3} tokens, but max_model_len is 256")
    growth = _rss_bytes(server.pid) - rss_before
    print(f"server RSS growth after {len(bodies)} 10 MB bodies: {growth / 2**20:.0f} MiB")
    assert growth < 512 * 2**20  # tokenizing them (the old path) grew it by over 1.5 GiB
    ok = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200
    assert server.wait_idle()["num_used_kv_blocks"] == 0


def test_a_text_at_the_character_bound_is_tokenized_one_past_it_is_not(tiny_server: ServerProcess) -> None:
    """Texts up to max_model_len x the longest token's characters may fit, so they are tokenized
    (in the worker thread: the padded body is over 64 kB); one character more cannot fit."""
    bound = 256 * 13  # max_model_len x the tiny tokenizer's longest token (13 characters)
    padding = "p" * 70_000  # an ignored field: the body goes to the preprocessing thread
    for text, expected in (
        ("a" * bound, f"prompt: {bound} tokens, but max_model_len is 256"),  # one token per character
        ("a" * (bound + 1), f"prompt: {bound + 1} characters cannot fit in max_model_len 256 tokens"),
    ):
        body = {"model": MODEL, "prompt": text, "max_tokens": 1, "user": padding}
        response = tiny_server.http.post("/v1/completions", json=body)
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (
            400,
            "prompt",
            "context_length_exceeded",
        )
        assert error["message"].startswith(expected), error["message"]
    fits = tiny_server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello world! " * 10, "max_tokens": 1, "user": padding},
    )
    assert fits.status_code == 200, fits.text
