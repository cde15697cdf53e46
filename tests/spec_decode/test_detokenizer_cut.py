"""Several tokens at once (a speculative step) with a stop string among them: the detokenizer
says how many belong to the output, exactly as if they had arrived one at a time."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from baton_engine.text.detokenizer import IncrementalDetokenizer
from baton_engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend=backend)


@pytest.mark.parametrize(
    ("chunks", "stop", "kept", "text"),
    [
        (["ab", "cdXYef"], "XY", [2, 4], "abcd"),  # the stop ends at the 4th token of the run
        (["abcXY"], "XY", [5], "abc"),
        (["aX", "Yzz"], "XY", [2, 1], "a"),  # straddles two steps
        (["abc", "def"], "XY", [3, 3], "abcdef"),  # no stop: everything is kept
        (["a", "é日z"], "日", [1, 5], "aé"),  # multi-byte: completed by the 3rd byte of 日
    ],
)
def test_num_ids_kept(
    byte_tokenizer: Tokenizer, chunks: list[str], stop: str, kept: list[int], text: str
) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, stop=[stop])
    got = []
    for chunk in chunks:
        delta = detok.add(byte_tokenizer.encode(chunk))
        got.append(delta.num_ids_kept)
        if delta.stopped:
            break
    if not detok.stopped:
        detok.finish()
    assert got == kept
    assert detok.output_text == text
