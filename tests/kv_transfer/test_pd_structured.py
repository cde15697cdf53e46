"""Structured output across P/D: two `baton-engine serve` processes (a tiny random model with a
real tokenizer, CPU) on 127.0.0.1, the test playing the router. The prefill leg samples the
answer's first token under the grammar; the decode leg's grammar continues from that token, so
the answer is valid under the schema and equals a single engine's (seeded sampling is keyed by
output position, so which engine samples a token changes nothing, nor do the n-gram drafts the
decode leg verifies under the grammar). A decode leg whose grammar
refuses the prefill leg's token is refused naming ``kv_transfer_params``, and frees its blocks."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from baton_support.tiny_models import CHAT
from tests.kv_transfer.helpers import KEY
from tests.pd_setup import pd_environment, serve_args
from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "tiny-chat"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
FLAGS: dict[str, Any] = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    model = tmp_path_factory.mktemp("pd-structured") / NAME
    CHAT.save(model)
    logs = tmp_path_factory.mktemp("pd-structured-logs")
    started: list[ServerProcess] = []
    with pd_environment(KEY.decode()):
        try:
            for role in ("producer", "consumer"):
                args = serve_args(role, num_kv_blocks=128, lease_seconds=30, name=NAME)
                if role == "consumer":  # the decode leg verifies n-gram drafts under the grammar
                    args += ("--speculative", "ngram", "--num-speculative-tokens", "3")
                started.append(ServerProcess(str(model), *args, log_path=logs / f"{role}.log"))
            yield started[0], started[1]
        finally:
            for server in started:
                server.stop(signal.SIGKILL, timeout=10)


def _body(schema: dict[str, Any], seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": "Hello world! Answer as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 100,
        **extra,
    }


def _post(server: ServerProcess, body: dict[str, Any]) -> Any:
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _disaggregated(
    servers: tuple[ServerProcess, ServerProcess], schema: dict[str, Any], seed: int
) -> tuple[int, int]:
    """One request through both legs, checked against the producer's answer alone; the
    consumer's draft count before and after it."""
    producer, consumer = servers
    single = _post(producer, _body(schema, seed))["choices"][0]["message"]["content"]
    first = _post(producer, _body(schema, seed, kv_transfer_params={"do_remote_decode": True}))
    assert first["usage"]["completion_tokens"] == 1
    assert single.startswith(first["choices"][0]["message"]["content"])
    drafts_before = consumer.stats()["spec_num_drafts"]
    second = _post(consumer, _body(schema, seed, kv_transfer_params=first["kv_transfer_params"]))
    choice = second["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    # the speculating decode leg wrote what the producer wrote alone, token for token
    assert choice["message"]["content"] == single
    stats = consumer.wait_idle()
    assert stats["num_grammar_requests"] == 0
    return drafts_before, stats["spec_num_drafts"]


@pytest.mark.parametrize(("schema", "seed"), [(PERSON, 2), (FLAGS, 3)])
def test_the_decode_leg_continues_the_prefill_legs_grammar(
    servers: tuple[ServerProcess, ServerProcess], schema: dict[str, Any], seed: int
) -> None:
    _disaggregated(servers, schema, seed)


def test_the_decode_leg_verifies_drafts_under_the_grammar(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    before, after = _disaggregated(servers, PERSON, 1)  # an answer n-gram drafting finds repeats in
    assert after > before


def test_a_decode_leg_whose_grammar_refuses_the_first_token_is_refused(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    producer, consumer = servers
    first = _post(producer, _body(PERSON, 4, kv_transfer_params={"do_remote_decode": True}))
    assert first["choices"][0]["message"]["content"] == "{"
    # the decode leg asks for an array: its grammar cannot start with the object's "{"
    body = _body(FLAGS, 4, kv_transfer_params=first["kv_transfer_params"])
    response = consumer.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert error["message"].startswith("kv_transfer_params: the prefill leg's first token ")
    assert "is refused by the request's grammar" in error["message"]
    stats = consumer.wait_idle()
    assert stats["num_grammar_requests"] == 0 and stats["num_used_kv_blocks"] == 0
    producer.wait_idle()  # the consumer's pull ended the producer's lease
