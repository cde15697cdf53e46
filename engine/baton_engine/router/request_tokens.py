"""A ``prefix.RequestTokenizer`` over the engine's tokenizer (``baton_engine.text.tokenizer.Tokenizer``,
torch-free), typed structurally so this module needs no import of it.

Prompts become token ids as the engine's server makes them: a completions prompt given as text is
encoded with special tokens (BOS), given as ids is taken as is; a chat request's messages are
normalised as the engine's server normalises them (text parts joined, a missing content empty,
only role, content and name kept), rendered with the model's chat template with the generation
prompt (the engine's server honours no template options) and encoded without adding special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from baton_engine.router.prefix import Api


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]: ...


class EngineRequestTokenizer:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt_token_ids(self, api: Api, body: Mapping[str, Any]) -> list[int]:
        if api == "chat":
            return self.tokenizer.encode_chat(chat_messages(body.get("messages")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return list(prompt)
        raise ValueError("prompt: must be a string, a list of token ids, or a batch of them")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages the engine's chat template sees (``server.protocol.chat_messages``)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]: must be an object")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
        if content is None:
            content = ""
        entry: dict[str, Any] = {"role": message.get("role"), "content": content}
        if message.get("name") is not None:
            entry["name"] = message["name"]
        out.append(entry)
    return out
