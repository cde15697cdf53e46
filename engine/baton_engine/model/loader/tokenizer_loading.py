"""A model reference's tokenizer and chat template, without weights and without torch.

Shared by the engine's server process and the router (which must tokenize exactly as the
engines do for prefix routing): ``builtin:`` and GGUF files read ``tokenizer.ggml.*`` metadata
(the `gguf` package is numpy-only), directories and ``hf:`` snapshots read tokenizer.json.
"""

from __future__ import annotations

from baton_engine.model.loader.gguf_file import open_gguf
from baton_engine.model.loader.gguf_tokenizer import tokenizer_from_gguf
from baton_engine.model.loader.reference import resolve_model
from baton_engine.text.tokenizer import Tokenizer


class NoTokenizerError(ValueError):
    """The model reference has no tokenizer files."""


def load_tokenizer(reference: str) -> Tokenizer:
    """The tokenizer of `reference` (raises `ModelNotFoundError` or `NoTokenizerError`)."""
    resolved = resolve_model(reference)
    if resolved.format == "gguf":
        return tokenizer_from_gguf(open_gguf(resolved.path))
    tokenizer = Tokenizer.from_pretrained_dir(resolved.path)
    if tokenizer is None:
        raise NoTokenizerError(f"model {reference!r} has no tokenizer.json in {resolved.path}")
    return tokenizer
