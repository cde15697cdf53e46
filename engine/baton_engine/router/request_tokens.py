"""A ``prefix.RequestTokenizer`` over the engine's tokenizer (``baton_engine.tokenizer.Tokenizer``,
torch-free), typed structurally so this module needs no import of it.

Prompts become token ids as the engine's server makes them: a completions prompt given as text is
encoded with special tokens (BOS), given as ids is taken as is; a chat request's messages are
rendered with the model's chat template (generation prompt on unless the request says otherwise,
``chat_template_kwargs`` passed through) and encoded without adding special tokens.
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
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ValueError("messages: must be a list")
            extra = body.get("chat_template_kwargs") or {}
            if not isinstance(extra, dict):
                raise ValueError("chat_template_kwargs: must be an object")
            generation = bool(body.get("add_generation_prompt", True))
            return self.tokenizer.encode_chat(messages, generation, **extra)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return list(prompt)
        raise ValueError("prompt: must be a string, a list of token ids, or a batch of them")
