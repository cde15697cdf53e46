"""SmolLM2-135M-Instruct on CPU (float32): greedy outputs with n-gram speculation are identical
to outputs without it for 18 chat prompts, among them prompts whose copied text ends in EOS and a
stop string inside the copied span, where the verify step accepted tokens past the stop."""

from __future__ import annotations

import pytest

from baton_engine.core.sampling_params import SamplingParams
from bench.speculative import INSTRUCTIONS, PARAGRAPHS
from tests.spec_decode.runs import generate, make_llm

MODEL = "builtin:smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours.",
    "Explain what a prime number is.",
    "Count from one to ten.",
    "Give me a recipe for pancakes.",
    "What does a cat eat?",
    "Name the planets of the solar system.",
]
STOP = "their nets"


def chats(llm) -> list[list[int]]:  # type: ignore[no-untyped-def]
    messages = [f"Repeat exactly: {p.split('.')[0]}." for p in PARAGRAPHS[:2]]
    messages += [INSTRUCTIONS[i % 4].format(text=PARAGRAPHS[i % 4]) for i in range(8)]
    messages += QUESTIONS
    return [
        llm.tokenizer.encode_chat([{"role": "user", "content": m}], add_generation_prompt=True)
        for m in messages
    ]


@pytest.mark.slow
def test_smollm2_greedy_identical_with_and_without_speculation() -> None:
    settings = dict(dtype="float32", max_model_len=512)
    off_llm = make_llm(MODEL, **settings)
    prompts = chats(off_llm)
    assert len(prompts) == 18
    params = [SamplingParams(temperature=0, max_tokens=32)] * len(prompts)
    stop_request = 2  # "Repeat the following text exactly" of the first paragraph
    params[stop_request] = SamplingParams(temperature=0, max_tokens=32, stop=[STOP])
    off = generate(off_llm, prompts, params)
    on = generate(make_llm(MODEL, k=5, **settings), prompts, params)
    assert on.token_ids() == off.token_ids()
    assert on.finish_reasons() == off.finish_reasons()
    assert [o.outputs[0].text for o in on.outputs] == [o.outputs[0].text for o in off.outputs]
    assert on.stats.spec_accepted_tokens > 0 and on.stats.num_steps < off.stats.num_steps
    # The stop string sat inside an accepted run: tokens past it were generated, then cut.
    stopped = on.outputs[stop_request].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_string == STOP
    assert stopped.text.endswith("Fishermen check ")
    assert on.generated(stop_request) > len(stopped.token_ids)
    # EOS accepted as a draft (the copied sentence is followed by <|im_end|> in the prompt).
    eos_inside = [
        i
        for i, out in enumerate(on.outputs)
        if out.outputs[0].finish_reason == "stop"
        and on.generated(i) > len(out.outputs[0].token_ids)
        and i != stop_request
    ]
    assert eos_inside, [o.outputs[0].text for o in on.outputs[:2]]
    assert on.stats.num_used_kv_blocks == 0 and off.stats.num_used_kv_blocks == 0
