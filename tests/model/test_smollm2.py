"""SmolLM2-135M-Instruct (the builtin GGUF, Q4_1): tokenizer and greedy parity with transformers.

transformers loads the same GGUF (dequantized with the `gguf` package) as the reference.
Float32 on both sides: tokens must be identical, except that a divergence is tolerated at a step
where the reference's top-2 logit gap is below 1e-4 (then that prompt is compared no further).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.model.loader.model_loading import LoadedModel, load_model
from baton_engine.model.loader.reference import resolve_model
from baton_engine.worker.model_runner import ModelRunner
from tests.model.driver import TestDriver

pytestmark = pytest.mark.model

TIE_GAP = 1e-4
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "Unicode: café, naïve, 日本語, emoji 🎉 done",
    "def f(x):\n    return x * 2\n\n",
    "<|im_start|>user\nhi<|im_end|>",
    "tabs\tand\nnewlines\r\n",
    "",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_model("builtin:smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m-instruct", "cpu", torch.float32)


def test_encode_matches_transformers(loaded: LoadedModel, hf_tokenizer: Any) -> None:
    assert loaded.tokenizer is not None
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        ids = loaded.tokenizer.encode(text)
        assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(loaded: LoadedModel) -> None:
    # The GGUF's pre-tokenizer is "smollm": like SmolLM2's own tokenizer.json, every digit is a
    # token of its own (transformers' GGUF converter ignores `tokenizer.ggml.pre` here).
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode("2024")
    assert [loaded.tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_matches_transformers(loaded: LoadedModel, hf_tokenizer: Any) -> None:
    assert loaded.tokenizer is not None
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected_text = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert loaded.tokenizer.render_chat(messages, add_generation_prompt) == expected_text
            expected_ids = hf_tokenizer(expected_text, add_special_tokens=False)["input_ids"]
            assert loaded.tokenizer.encode_chat(messages, add_generation_prompt) == expected_ids
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.tokenizer.eos_token_ids == (2,)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    assert tok is not None
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.",
        "List three prime numbers.",
        "Who wrote Hamlet?",
        "Translate 'good morning' to Spanish.",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    long_context = " ".join(["Baton passes the KV cache from prefill pods to decode pods."] * 8)
    prompts.append(tok.encode_chat([{"role": "user", "content": long_context + " Summarise this."}]))
    prompts.append(tok.encode_chat([{"role": "user", "content": long_context + " Why?"}]))
    plain = [
        "The theory of relativity",
        "Once upon a time",
        "import numpy as np\n",
        "The",
        "Paris is",
        "In 1969, the first humans",
        "Q: What is two plus two?\nA:",
        "A list of fruits: apple, banana,",
    ]
    prompts += [tok.encode(text) for text in plain]
    return prompts


@pytest.mark.slow
def test_greedy_matches_transformers_gguf_float32(loaded: LoadedModel, gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    prompts = _prompts(loaded)
    new_tokens = [8 + (i * 7) % 17 for i in range(len(prompts))]  # 8..24

    runner = ModelRunner(
        EngineConfig(model="builtin:smollm2-135m-instruct", dtype="float32", block_size=8, num_kv_blocks=400),
        loaded=loaded,
    )
    driver = TestDriver(runner, max_num_batched_tokens=64, max_num_seqs=4)
    got = [seq.outputs for seq in driver.generate(prompts, new_tokens)]
    assert driver.stats.prefix_hit_tokens > 0 and driver.stats.chunked_prefill_rows > 0

    tolerated: list[tuple[int, int, float]] = []
    for index, (prompt, count) in enumerate(zip(prompts, new_tokens, strict=True)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            result = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=count,
                eos_token_id=None,
                pad_token_id=2,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected = result.sequences[0, len(prompt) :].tolist()
        for step, (mine, theirs) in enumerate(zip(got[index], expected, strict=True)):
            if mine == theirs:
                continue
            top2 = result.logits[step][0].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_GAP, (index, step, mine, theirs, gap)
            tolerated.append((index, step, gap))
            break
    if tolerated:
        print(f"near-tie divergences tolerated (prompt, step, top-2 gap): {tolerated}")
    assert len(prompts) >= 16
