"""Grammar masks on the GPU runner: bitmasks staged through pinned buffers and applied with
tensor ops after the forward (captured decode and verify graphs included), under
``set_sync_debug_mode("error")``; the answers equal the reference runner's, are valid under
their schemas, and steps with a grammar are never run ahead.

Runs only where CUDA (or ROCm) torch sees a device; CI has none, the device machine runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.llm import LLM
from baton_engine.structured.grammar import json_schema_grammar
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import CHAT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
FLAGS: dict[str, Any] = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 5}


def _llm(model_dir: Path, fast: bool, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> LLM:
    monkeypatch.setenv("BATON_GPU_FAST_PATH", "1" if fast else "0")
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        num_kv_blocks=64,
        **extra,
    )
    if fast:
        assert isinstance(llm.core.runner, GpuModelRunner)
        llm.core.runner.sync_debug = True
    else:
        assert type(llm.core.runner) is ModelRunner
    return llm


def _requests(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    prompt = llm.tokenizer.encode("Hello world! How are you today?")
    params = [
        SamplingParams(temperature=0.0, max_tokens=100, grammar=json_schema_grammar(PERSON)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=100, grammar=json_schema_grammar(FLAGS)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=100, grammar=json_schema_grammar(PERSON)),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # free text beside them
    ]
    return [prompt] * len(params), params


@pytest.mark.parametrize("speculative", [False, True])
def test_masked_graph_steps_match_the_reference_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speculative: bool
) -> None:
    CHAT.save(tmp_path / "chat")
    reference_llm = _llm(tmp_path / "chat", False, monkeypatch)
    prompts, params = _requests(reference_llm)
    reference = reference_llm.generate(prompts, params)
    extra = (
        dict(speculative="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3) if speculative else {}
    )
    fast_llm = _llm(tmp_path / "chat", True, monkeypatch, **extra)
    runner = fast_llm.core.runner
    assert isinstance(runner, GpuModelRunner)
    fast = fast_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in reference]
    for out, schema in zip(fast[:3], (PERSON, FLAGS, PERSON), strict=True):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert runner._grammar_staging  # the masks went through the pinned buffers
    assert fast_llm.core.stats().num_grammar_requests == 0
