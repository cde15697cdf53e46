"""Token bytes for logprobs: each token's own bytes, also for tokens that split a character."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.server.openai_format import TokenText


@pytest.fixture(scope="module")
def smollm2() -> TokenText:
    return TokenText(load_tokenizer("builtin:smollm2-135m-instruct"))


def test_a_party_popper_is_split_into_its_own_bytes(smollm2: TokenText) -> None:
    ids = smollm2.tokenizer.encode("🎉", add_special_tokens=False)
    assert ids == [10813, 232, 227]
    assert [smollm2(i) for i in ids] == ["\ufffd", "\ufffd", "\ufffd"]  # no piece is text on its own
    assert [smollm2.token_bytes(i) for i in ids] == [[0xF0, 0x9F], [0x8E], [0x89]]
    assert bytes(sum((smollm2.token_bytes(i) for i in ids), [])) == "🎉".encode()


@pytest.mark.parametrize(
    "text", ["🎉" * 10, "Hello wörld, ça va? 日本語", " two  spaces\nand a newline", "<|im_start|>"]
)
def test_token_bytes_rebuild_the_text(smollm2: TokenText, text: str) -> None:
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(smollm2.token_bytes(i)) for i in ids) == text.encode()


def test_special_tokens_are_their_text(smollm2: TokenText) -> None:
    eos = smollm2.tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    assert smollm2.token_bytes(eos) == list(b"<|im_end|>")


def test_tiny_byte_level_tokenizer(tiny_model_dir: Path) -> None:
    from baton_engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained_dir(tiny_model_dir)
    assert tokenizer is not None
    token_text = TokenText(tokenizer)
    text = "Hello world! ✓ ok"
    ids = tokenizer.encode(text)
    assert b"".join(bytes(token_text.token_bytes(i)) for i in ids) == text.encode()
