"""Text <-> token ids for one model: a `tokenizers` backend plus its chat template and specials."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from baton_engine.text.chat_template import ChatTemplateError, render_chat


@dataclass
class Tokenizer:
    backend: BackendTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool = False
    """Prepend BOS on `encode` when the backend's post-processor does not already do it."""
    eos_token_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it): a long prompt tokenized
        # in a worker thread then leaves the server's event loop free.
        ids: list[int] = list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use completions instead")
        specials = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=specials,
            **extra,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered conversation; the template itself places BOS where it wants it."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False
        )

    @classmethod
    def from_pretrained_dir(cls, directory: Path) -> Tokenizer | None:
        """From tokenizer.json (+ tokenizer_config.json, chat_template.jinja); None without tokenizer.json."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        backend = BackendTokenizer.from_file(str(path))
        settings: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            settings = json.loads(config_path.read_text())
        template = settings.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {entry.get("name"): entry.get("template") for entry in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()

        def token(key: str) -> str | None:
            value = settings.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else None

        eos = token("eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        return cls(
            backend=backend,
            chat_template=template if isinstance(template, str) else None,
            bos_token=token("bos_token"),
            eos_token=eos,
            pad_token=token("pad_token"),
            unk_token=token("unk_token"),
            add_bos_token=bool(settings.get("add_bos_token", False)),
            eos_token_ids=() if eos_id is None else (int(eos_id),),
            special_ids=_special_ids(backend),
        )


def _special_ids(backend: BackendTokenizer) -> frozenset[int]:
    return frozenset(int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
