"""Incremental detokenization: split multi-byte characters, stop strings across tokens, truncation."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from baton_engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from baton_engine.text.tokenizer import Tokenizer

END = "<|end|>"


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (byte-level BPE without merges) plus a special token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(END, special=True, normalized=False)])
    return Tokenizer(backend=backend, eos_token=END)


def _stream(tok: Tokenizer, text: str, stop: list[str] | None = None) -> tuple[list[DetokenizerDelta], str]:
    detok = IncrementalDetokenizer(tok, stop=stop or [])
    deltas: list[DetokenizerDelta] = []
    for token in tok.encode(text):
        deltas.append(detok.add([token]))
        if detok.stopped:
            return deltas, detok.output_text
    deltas.append(detok.finish())
    return deltas, detok.output_text


def test_multibyte_characters_are_never_split(byte_tokenizer: Tokenizer) -> None:
    text = "aé日🎉z"
    assert len(byte_tokenizer.encode(text)) == 1 + 2 + 3 + 4 + 1
    deltas, output = _stream(byte_tokenizer, text)
    assert [d.text for d in deltas] == ["a", "", "é", "", "", "日", "", "", "", "🎉", "z", ""]
    assert output == text
    assert not any("\ufffd" in d.text for d in deltas)


def test_stop_string_across_tokens_truncates_before_it(byte_tokenizer: Tokenizer) -> None:
    deltas, output = _stream(byte_tokenizer, "Hi STOP more", stop=["STOP"])
    assert [d.text for d in deltas] == ["H", "i", " ", "", "", "", ""]
    assert deltas[-1].stopped and deltas[-1].stop_string == "STOP"
    assert not any(d.stopped for d in deltas[:-1])
    assert output == "Hi "


def test_false_start_of_a_stop_string_is_released(byte_tokenizer: Tokenizer) -> None:
    deltas, output = _stream(byte_tokenizer, "STx ST", stop=["STOP"])
    assert [d.text for d in deltas] == ["", "", "STx", " ", "", "", "ST"]
    assert output == "STx ST"
    assert not any(d.stopped for d in deltas)


def test_earliest_of_several_stop_strings_wins(byte_tokenizer: Tokenizer) -> None:
    _, output = _stream(byte_tokenizer, "one two three", stop=["three", "two", "wo t"])
    assert output == "one "


def test_stop_string_at_the_very_start_gives_empty_output(byte_tokenizer: Tokenizer) -> None:
    deltas, output = _stream(byte_tokenizer, "###rest", stop=["##"])
    assert output == ""
    assert deltas[1].stop_string == "##"
    assert len(deltas) == 2


def test_multibyte_stop_string(byte_tokenizer: Tokenizer) -> None:
    deltas, output = _stream(byte_tokenizer, "ab日本cd", stop=["日本"])
    assert output == "ab"
    assert deltas[-1].stop_string == "日本"


def test_adding_after_stop_returns_nothing(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["x"])
    assert detok.add(byte_tokenizer.encode("ax")) == DetokenizerDelta("a", "x")
    assert detok.add(byte_tokenizer.encode("bc")) == DetokenizerDelta("", "x")
    assert detok.finish() == DetokenizerDelta("", "x")
    assert detok.output_text == "a"


def test_special_tokens_are_skipped_by_default(byte_tokenizer: Tokenizer) -> None:
    end_id = byte_tokenizer.token_to_id(END)
    assert end_id is not None
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert detok.add(byte_tokenizer.encode("ok") + [end_id]).text == "ok"
    assert detok.finish().text == ""
    keep = IncrementalDetokenizer(byte_tokenizer, skip_special_tokens=False)
    keep.add(byte_tokenizer.encode("ok") + [end_id])
    assert keep.finish().text == "" and keep.output_text == "ok" + END


def test_finish_releases_held_prefix_and_incomplete_bytes(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    assert detok.add(byte_tokenizer.encode("go S")).text == "go "
    assert detok.finish().text == "S"
    broken = IncrementalDetokenizer(byte_tokenizer)
    first_byte_of_e_acute = byte_tokenizer.encode("é")[0]
    assert broken.add([first_byte_of_e_acute]).text == ""
    assert broken.finish().text == "\ufffd"


def test_prompt_context_does_not_leak_into_output(byte_tokenizer: Tokenizer) -> None:
    prompt = byte_tokenizer.encode("prompt text ")
    detok = IncrementalDetokenizer(byte_tokenizer, prompt_ids=prompt)
    pieces = [detok.add([t]).text for t in byte_tokenizer.encode("answer")]
    assert "".join(pieces) == "answer"


def test_chunks_of_tokens_give_the_same_text(byte_tokenizer: Tokenizer) -> None:
    text = "mixed 日本語 text with emoji 🎉🎉 and a STOP marker"
    ids = byte_tokenizer.encode(text)
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    streamed = "".join(detok.add(ids[i : i + 3]).text for i in range(0, len(ids), 3))
    assert streamed == "mixed 日本語 text with emoji 🎉🎉 and a "
    assert detok.stopped
