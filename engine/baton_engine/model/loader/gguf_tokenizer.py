"""A `tokenizers` BPE tokenizer and chat template rebuilt from GGUF metadata (`tokenizer.ggml.*`)."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from baton_engine.text.tokenizer import Tokenizer

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names -> the split applied before byte-level BPE.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _array(reader: Any, key: str) -> list[Any]:
    field = reader.fields.get(key)
    return [] if field is None else list(field.contents())


def _scalar(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        # SmolLM2 (and StarCoder) split every digit on its own before the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    pattern = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if pattern is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def tokenizer_from_gguf(reader: Any) -> Tokenizer:
    kind = _scalar(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)")
    tokens: list[str] = _array(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _array(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _array(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(_scalar(reader, "tokenizer.ggml.pre") or "default"))
    backend.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)

    def token_of(key: str) -> str | None:
        index = _scalar(reader, key)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    eos_id = _scalar(reader, "tokenizer.ggml.eos_token_id")
    template = _scalar(reader, "tokenizer.chat_template")
    return Tokenizer(
        backend=backend,
        chat_template=str(template) if template is not None else None,
        bos_token=token_of("tokenizer.ggml.bos_token_id"),
        eos_token=token_of("tokenizer.ggml.eos_token_id"),
        pad_token=token_of("tokenizer.ggml.padding_token_id"),
        unk_token=token_of("tokenizer.ggml.unknown_token_id"),
        add_bos_token=bool(_scalar(reader, "tokenizer.ggml.add_bos_token") or False),
        eos_token_ids=() if eos_id is None else (int(eos_id),),
        special_ids=frozenset(i for i, t in enumerate(token_types) if t == _TOKEN_TYPE_CONTROL),
    )
