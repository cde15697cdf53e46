"""OpenAI response shapes: completion and chat objects, stream chunks, logprobs."""

from __future__ import annotations

import json
import re
import time
from functools import cache
from typing import Any

from baton_engine.core.outputs import TokenLogprobs
from baton_engine.text.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character: that map, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(tokenizer: Tokenizer) -> set[str]:
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {str(part.get("type")) for part in parts if isinstance(part, dict)}


class TokenText:
    """Token id -> its text piece and its bytes, cached (logprobs name tokens by text, and give
    each token's own bytes so that a client can rebuild text split inside a UTF-8 character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in types
        self._metaspace = bool(types & {"Metaspace", "Replace"})

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes token `token_id` stands for (a piece of a character has no text of its own)."""
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._compute_bytes(token_id)
        return found

    def _compute_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is None or token_id in self.tokenizer.special_ids:
            return list(self(token_id).encode("utf-8"))
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        if self._metaspace:
            piece = piece.replace(_METASPACE, " ")
        return list(piece.encode("utf-8"))


MIN_LOGPROB = -9999.0
"""What a logprob of -inf is reported as (OpenAI's own floor): JSON has no infinity, and a
grammar's mask gives every refused token -inf."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


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
        token_logprobs.append(_finite(logprob))
        top.append({token_text(t): _finite(lp) for t, lp in rest})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    return {
        "token": token_text(token_id),
        "logprob": _finite(logprob),
        "bytes": token_text.token_bytes(token_id),
    }


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
