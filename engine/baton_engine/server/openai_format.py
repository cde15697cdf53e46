"""OpenAI response shapes: completion and chat objects, stream chunks, logprobs."""

from __future__ import annotations

import time
from typing import Any

from baton_engine.core.outputs import TokenLogprobs
from baton_engine.text.tokenizer import Tokenizer


class TokenText:
    """Token id -> its text piece, cached (logprobs name tokens by text)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(
    entries: list[TokenLogprobs], token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for some generated tokens."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = text_offset
    for entry in entries:
        (token_id, logprob), rest = entry[0], entry[1:]
        piece = token_text(token_id)
        tokens.append(piece)
        token_logprobs.append(logprob)
        top.append({token_text(t): lp for t, lp in rest})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    piece = token_text(token_id)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    content = []
    for entry in entries:
        (token_id, logprob), rest = entry[0], entry[1:]
        item = _chat_token(token_id, logprob, token_text)
        item["top_logprobs"] = [_chat_token(t, lp, token_text) for t, lp in rest]
        content.append(item)
    return {"content": content}


def now() -> int:
    return int(time.time())
