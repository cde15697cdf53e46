"""The offline `LLM` API (same core, in-process) and the IPC wire format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from baton_engine.core.outputs import RequestOutput
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints import ipc


def test_offline_path_imports_no_server_dependency() -> None:
    code = (
        "import sys, baton_engine.entrypoints.llm, baton_engine.core.engine_core, "
        "baton_engine.entrypoints.engine_factory;"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'zmq', 'starlette', 'prometheus_client') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_request_output_wire_roundtrip() -> None:
    out = RequestOutput(
        "r-1", [5, 6], True, "stop", "eos", [[(5, -0.5), (5, -0.5), (7, -1.25)]], 12, 8, 0.125
    )
    kind, payload = ipc.decode(ipc.encode(ipc.OUTPUTS, [[out.to_wire()], {}]))
    assert kind == ipc.OUTPUTS
    assert RequestOutput.from_wire(payload[0][0]) == out


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from baton_engine.entrypoints.llm import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=256)


def test_generate_token_and_text_prompts(llm) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ids = llm.tokenizer.encode("Hello world")
    by_text, by_ids = llm.generate(["Hello world", ids], params)
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_text.outputs[0].token_ids) == 12
    assert by_text.outputs[0].finish_reason == "length"
    logprobs = by_text.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 12
    assert [entry[0][0] for entry in logprobs] == by_text.outputs[0].token_ids
    assert all(len(entry) == 3 for entry in logprobs)


def test_stop_string_truncates_and_aborts(llm) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("The quick brown fox", greedy)[0].outputs[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = text.index(stop)
    out = llm.generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )
    completion = out[0].outputs[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop"
    assert completion.stop_string == stop
    assert len(completion.token_ids) < 40
    assert llm.core.scheduler.block_manager.num_used_blocks == 0


def test_seeded_n_is_reproducible(llm) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, n=2)
    first = llm.generate([[1, 2, 3]], params)[0]
    again = llm.generate([[1, 2, 3]], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert llm.core.scheduler.block_manager.num_used_blocks == 0
    assert not llm.core.has_unfinished()
