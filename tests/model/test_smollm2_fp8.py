"""SmolLM2-135M-Instruct (the builtin GGUF) quantized to FP8 on load, on the CPU: over 64 greedy
tokens on 8 prompts, at least 90% of the FP8 model's greedy choices agree with the float32
model's on the same context (each position fed the float32 model's own continuation)."""

from __future__ import annotations

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.model.linear import ParallelLinear
from baton_engine.worker.model_runner import ModelRunner
from tests.model.driver import TestDriver, prefill_logits

pytestmark = [pytest.mark.model, pytest.mark.slow]

NEW_TOKENS = 64
TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three primary colors:",
    "Once upon a time, in a small village by the mountains,",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: good morning, my friend.",
]


def test_fp8_on_load_keeps_greedy_tokens() -> None:
    settings = dict(model="builtin:smollm2-135m-instruct", dtype="float32", block_size=16, num_kv_blocks=256)
    exact = ModelRunner(EngineConfig(**settings))  # type: ignore[arg-type]
    fp8 = ModelRunner(EngineConfig(**settings, quantization="fp8"))  # type: ignore[arg-type]
    linears = [m for m in fp8.model.modules() if isinstance(m, ParallelLinear)]
    assert len(linears) == 30 * 4 and {m.weight.dtype for m in linears} == {torch.float8_e4m3fn}
    tokenizer = exact.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(t) for t in TEXTS]
    references = TestDriver(exact, 512, 8).generate(prompts, [NEW_TOKENS] * len(prompts))
    agree = total = 0
    for prompt, ref in zip(prompts, references, strict=True):
        context = prompt + ref.outputs[:-1]
        choices = prefill_logits(fp8.model, context)[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(choices, ref.outputs, strict=True))
        total += NEW_TOKENS
    assert total == 8 * 64
    assert agree / total >= 0.9, f"{agree} of {total} greedy tokens agree"
