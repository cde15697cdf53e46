"""`baton-engine serve --speculative ngram` with SmolLM2: over HTTP a stop string inside an
accepted run cuts text, token count and logprobs exactly like decoding without speculation, and
`/metrics` carries the acceptance statistics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from baton_engine import contract
from baton_engine.core.sampling_params import SamplingParams
from bench.speculative import INSTRUCTIONS, PARAGRAPHS
from tests.server.server_process import ServerProcess
from tests.spec_decode.runs import generate, make_llm

MODEL = "builtin:smollm2-135m-instruct"
ARGS = (
    "--num-kv-blocks",
    "256",
    "--max-model-len",
    "512",
    "--dtype",
    "float32",
    "--served-model-name",
    "smol",
)
SPEC_ARGS = (
    "--speculative",
    "ngram",
    "--num-speculative-tokens",
    "5",
    "--ngram-min",
    "1",
    "--ngram-max",
    "3",
)
TEXT = PARAGRAPHS[0]
STOP = "their nets"  # inside the copied text; the verify step runs past it (see the SmolLM2 test)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    process = ServerProcess(MODEL, *ARGS, *SPEC_ARGS, log_path=log)
    yield process
    process.stop()


@pytest.mark.slow
def test_stop_string_inside_an_accepted_run_over_http(server: ServerProcess) -> None:
    llm = make_llm(MODEL, dtype="float32", max_model_len=512)
    message = INSTRUCTIONS[0].format(text=TEXT)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": message}], add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=24, stop=[STOP], logprobs=1)
    reference = generate(llm, [prompt], params).outputs[0].outputs[0]
    assert reference.finish_reason == "stop" and reference.text.endswith("Fishermen check ")

    body = {
        "model": "smol",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [STOP],
        "logprobs": 1,
    }
    before = server.stats()
    response = server.http.post("/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    assert choice["text"] == reference.text
    assert choice["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == len(reference.token_ids)
    assert len(choice["logprobs"]["tokens"]) == len(reference.token_ids)
    after = server.wait_idle()
    # The engine generated tokens past the stop string; none of them reached the client.
    assert after["generation_tokens"] - before["generation_tokens"] > len(reference.token_ids)

    streamed = server.http.post("/v1/completions", json={**body, "stream": True}, timeout=600)
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == reference.text
    assert server.wait_idle()["num_used_kv_blocks"] == 0


@pytest.mark.slow
def test_metrics_carry_acceptance_statistics(server: ServerProcess) -> None:
    prompt = f"Repeat the following text exactly, word for word:\n\n{TEXT}\n\n{TEXT}"
    response = server.http.post(
        "/v1/completions",
        json={"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0},
        timeout=600,
    )
    assert response.status_code == 200
    stats = server.wait_idle()
    text = server.http.get("/metrics").text
    samples = {
        line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton_spec_decode_")
    }
    label = '{model_name="smol"}'
    drafts = samples[contract.M_SPEC_DRAFT_TOKENS + label]
    accepted = samples[contract.M_SPEC_ACCEPTED_TOKENS + label]
    rows = samples[contract.M_SPEC_NUM_DRAFTS + label]
    assert drafts == stats["spec_draft_tokens"] and accepted == stats["spec_accepted_tokens"] > 0
    assert rows == stats["spec_num_drafts"] > 0
    per_position = [
        samples[f'{contract.M_SPEC_ACCEPTED_PER_POSITION}{{model_name="smol",position="{j}"}}']
        for j in range(5)
    ]
    assert per_position == stats["spec_accepted_per_position"]
    assert sum(per_position) == accepted
    assert samples[contract.M_SPEC_ACCEPTANCE_RATE + label] == pytest.approx(accepted / drafts)
    assert samples[contract.M_SPEC_TOKENS_PER_FORWARD + label] == pytest.approx(1 + accepted / rows)
