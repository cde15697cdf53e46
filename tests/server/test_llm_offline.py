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
    assert llm.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_seeded_n_is_reproducible(llm) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, n=2)
    first = llm.generate([[1, 2, 3]], params)[0]
    again = llm.generate([[1, 2, 3]], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert llm.core.scheduler.kv_cache_manager.num_used_blocks == 0
    assert not llm.core.has_unfinished()


def test_llm_and_sampling_params_are_exported_without_importing_torch() -> None:
    code = (
        "import sys, baton_engine; assert 'torch' not in sys.modules;"
        "from baton_engine import SamplingParams; assert 'torch' not in sys.modules;"
        "from baton_engine import LLM; import baton_engine.entrypoints.llm as m;"
        "assert LLM is m.LLM and SamplingParams is m.SamplingParams; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 2**31}, "top_k must be an integer in [-1, 2147483647]"),
        ({"top_k": -2}, "top_k must be an integer in [-1, 2147483647]"),
        ({"max_tokens": 2**31}, "max_tokens must be an integer in [1, 2147483647]"),
        ({"temperature": float("inf")}, "temperature must be a finite number in [0, 10000]"),
        ({"temperature": float("nan")}, "temperature must be a finite number in [0, 10000]"),
        ({"temperature": 1e5}, "temperature must be a finite number in [0, 10000]"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
        ({"seed": 2**63}, "seed must be an integer in [0, 2**63)"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids must be a list of integers in [0, 2147483647]"),
        ({"n": 17}, "n must be an integer in [1, 16]"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_represent(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value).startswith(message)


def test_bad_prompts_are_refused_before_the_engine_and_leave_it_usable(llm) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids
    vocab = llm.info.vocab_size
    with pytest.raises(ValueError) as caught:
        llm.generate([[1, 2, 3], [1, 2, 999999]], greedy)
    assert str(caught.value) == f"prompts[1]: token id 999999 is out of range [0, {vocab})"
    with pytest.raises(ValueError, match=r"^prompts\[0\]: token id -1 is out of range"):
        llm.generate([[-1]], greedy)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: a prompt must not be empty$"):
        llm.generate([[]], greedy)
    with pytest.raises(TypeError, match=r"^prompts\[1\] must be a string or a list of token ids"):
        llm.generate([[1, 2], [1.5, 2]], greedy)
    with pytest.raises(TypeError, match=r"^sampling_params\[0\] must be a SamplingParams, got dict$"):
        llm.generate([[1, 2]], [{"temperature": 0}])
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams or a list of them"):
        llm.generate([[1, 2]], {"temperature": 0})  # type: ignore[arg-type]
    assert not llm.core.has_unfinished()
    assert llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids == expected
    widest = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, top_k=2**31 - 1)
    assert llm.generate([[1, 2, 3]], widest)[0].outputs[0].token_ids == expected
    assert llm.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_failed_step_frees_its_requests_and_the_next_call_works(llm) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy)]
    runner = llm.core.runner
    real_execute = runner.execute
    calls = 0

    def fail_third_step(step):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:  # mid-generation: both requests hold KV blocks
            raise RuntimeError("device lost")
        return real_execute(step)

    runner.execute = fail_third_step
    try:
        with pytest.raises(RuntimeError, match="^device lost$"):
            llm.generate([[1, 2, 3], [4, 5]], greedy)
    finally:
        runner.execute = real_execute
    assert calls == 3
    assert not llm.core.has_unfinished()
    assert llm.core.scheduler.kv_cache_manager.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy)] == expected


def test_cpu_threads_sets_the_offline_engines_torch_threads(tiny_model_dir: Path) -> None:
    """`cpu_threads` was the served core's only: the offline LLM ignored it and ran on torch's
    default count. One thread also leaves no thread count for the engine to choose. The setting
    is the process's: a later LLM without it keeps the count it finds."""
    import torch

    from baton_engine.entrypoints.llm import LLM

    settings = {"model": str(tiny_model_dir), "dtype": "float32", "num_kv_blocks": 16, "max_model_len": 64}
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        default = LLM(**settings)
        assert torch.get_num_threads() == 2
        assert default.core.runner.step_threads is not None  # type: ignore[attr-defined]
        assert default.core.runner.step_threads.all_threads == 2  # type: ignore[attr-defined]
        single = LLM(**settings, cpu_threads=1)
        assert torch.get_num_threads() == 1
        assert single.core.runner.step_threads is None  # type: ignore[attr-defined]
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(single.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids) == 4
        later = LLM(**settings)
        assert torch.get_num_threads() == 1
        assert later.core.runner.step_threads is None  # type: ignore[attr-defined]
    finally:
        torch.set_num_threads(previous)
