"""Greedy outputs with speculation on are identical to outputs with it off (tiny random Llama,
float64), including stops (EOS, stop ids, max_tokens, max_model_len) placed deliberately inside a
run of accepted drafts: the stop truncates exactly as one-token-at-a-time decoding would."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton_engine.core.sampling_params import SamplingParams
from baton_support.tiny_models import with_eos
from tests.spec_decode.conftest import TINY_VOCAB as VOCAB
from tests.spec_decode.runs import first_occurrence_inside_accepted_run, generate, make_llm

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def prompts(count: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    found = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(count - 2)]
    return found + [[3, 4, 5] * 8, [7] * 5]  # plus two repetitive prompts


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identical_with_and_without_speculation(model_dir: Path, k: int) -> None:
    batch = prompts()
    off = generate(make_llm(str(model_dir)), batch, GREEDY)
    on = generate(make_llm(str(model_dir), k=k), batch, GREEDY)
    assert on.token_ids() == off.token_ids()
    assert all(len(tokens) == 40 for tokens in on.token_ids())
    assert on.stats.spec_accepted_tokens > 0
    assert on.stats.num_steps < off.stats.num_steps
    assert on.stats.num_used_kv_blocks == 0


def test_logprobs_identical_with_and_without_speculation(model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    batch = prompts(6)
    off = generate(make_llm(str(model_dir)), batch, params)
    on = generate(make_llm(str(model_dir), k=4), batch, params)
    assert on.stats.spec_accepted_tokens > 0
    for a, b in zip(off.outputs, on.outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert [lp for _, lp in x] == pytest.approx([lp for _, lp in y], abs=1e-9)


def _stop_inside_a_run(model_dir: Path) -> tuple[int, int, int]:
    """(request, output index, token): a token inside an accepted run, first of its kind."""
    batch = prompts()
    probe = generate(make_llm(str(model_dir), k=4), batch, GREEDY)
    for request in range(len(batch)):
        found = first_occurrence_inside_accepted_run(probe, request)
        if found is not None:
            return request, found[0], found[1]
    raise AssertionError("no draft run long enough in the probe: the test model changed")


def test_eos_inside_an_accepted_run(model_dir: Path, tmp_path: Path) -> None:
    request, position, token = _stop_inside_a_run(model_dir)
    eos_model = with_eos(model_dir, tmp_path / "eos", token)
    batch = prompts()
    off = generate(make_llm(str(eos_model)), batch, GREEDY)
    on = generate(make_llm(str(eos_model), k=4), batch, GREEDY)
    assert on.token_ids() == off.token_ids()
    out = on.outputs[request].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == position + 1 and out.token_ids[-1] == token
    # The step that produced EOS had accepted more tokens after it; they were cut.
    assert on.generated(request) > len(out.token_ids)
    assert sum(o.outputs[0].finish_reason == "stop" for o in on.outputs) >= 1
    assert on.stats.num_used_kv_blocks == 0


def test_stop_token_id_inside_an_accepted_run(model_dir: Path) -> None:
    request, position, token = _stop_inside_a_run(model_dir)
    params = [GREEDY] * len(prompts())
    params[request] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(token,))
    batch = prompts()
    off = generate(make_llm(str(model_dir)), batch, params)
    on = generate(make_llm(str(model_dir), k=4), batch, params)
    assert on.token_ids() == off.token_ids()
    out = on.outputs[request].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == position + 1
    assert on.generated(request) > len(out.token_ids)


def test_max_tokens_inside_an_accepted_run(model_dir: Path) -> None:
    request, position, _ = _stop_inside_a_run(model_dir)
    params = [GREEDY] * len(prompts())
    params[request] = SamplingParams(temperature=0, max_tokens=position + 1)
    batch = prompts()
    off = generate(make_llm(str(model_dir)), batch, params)
    on = generate(make_llm(str(model_dir), k=4), batch, params)
    assert on.token_ids() == off.token_ids()
    out = on.outputs[request].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == position + 1
    assert on.stats.num_used_kv_blocks == 0


def test_max_model_len_inside_an_accepted_run(model_dir: Path) -> None:
    request, position, _ = _stop_inside_a_run(model_dir)
    batch = prompts()
    limit = len(batch[request]) + position + 1
    settings = {"max_model_len": limit}
    # Prompts longer than the limit are rejected in both runs alike; the rest stop at the limit.
    off = generate(make_llm(str(model_dir), **settings), batch, GREEDY)  # type: ignore[arg-type]
    on = generate(make_llm(str(model_dir), k=4, **settings), batch, GREEDY)  # type: ignore[arg-type]
    assert on.token_ids() == off.token_ids()
    assert on.finish_reasons() == off.finish_reasons()
    out = on.outputs[request].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == position + 1
    assert on.stats.num_used_kv_blocks == 0
