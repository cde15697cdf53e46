"""Request -> prompt token ids, on a real (tiny, word-level) `tokenizers` tokenizer and a real jinja2
chat template, standing in for the engine's tokenizer until both branches meet."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from baton_engine.router.request_tokens import EngineRequestTokenizer

VOCAB = {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "user:": 4, "assistant:": 5, "sunny": 6}
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class WordTokenizer:
    def __init__(self) -> None:
        self.backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
        self.backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.template = jinja2.Environment().from_string(TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.backend.encode(text).ids)
        return [0, *ids] if add_special_tokens else ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        rendered = self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        )
        return self.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    ("api", "body", "ids"),
    [
        ("completions", {"prompt": "hello world"}, [0, 2, 3]),
        ("completions", {"prompt": ["hello", "world"]}, [0, 2]),
        ("completions", {"prompt": [7, 8, 9]}, [7, 8, 9]),
        ("completions", {"prompt": [[5, 6], [7]]}, [5, 6]),
        ("chat", {"messages": [{"role": "user", "content": "hello"}]}, [4, 2, 5]),
        # the engine's server renders with the generation prompt whatever the request says
        (
            "chat",
            {"messages": [{"role": "user", "content": "sunny"}], "add_generation_prompt": False},
            [4, 6, 5],
        ),
        # text parts are joined, as the engine's server joins them
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
            [4, 2, 5],
        ),
    ],
)
def test_prompt_token_ids(api: str, body: dict[str, Any], ids: list[int]) -> None:
    assert EngineRequestTokenizer(WordTokenizer()).prompt_token_ids(api, body) == ids  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("api", "body", "message"),
    [
        ("chat", {"messages": "hi"}, "messages: must be a non-empty list"),
        ("chat", {"messages": []}, "messages: must be a non-empty list"),
        ("chat", {"messages": ["hi"]}, r"messages\[0\]: must be an object"),
        ("completions", {"prompt": 5}, "prompt: must be a string"),
        ("completions", {}, "prompt: must be a string"),
    ],
)
def test_bad_requests_name_the_field(api: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineRequestTokenizer(WordTokenizer()).prompt_token_ids(api, body)  # type: ignore[arg-type]


@pytest.mark.model
def test_builtin_model_tokenizer_loads_without_torch() -> None:
    """The router tokenizes SmolLM2 chat requests from the GGUF file without importing torch."""
    import subprocess
    import sys

    code = (
        "import sys; from baton_engine.model.loader.tokenizer_loading import load_tokenizer; "
        "from baton_engine.router.request_tokens import EngineRequestTokenizer; "
        "t = EngineRequestTokenizer(load_tokenizer('builtin:smollm2-135m-instruct')); "
        "ids = t.prompt_token_ids('chat', {'messages': [{'role': 'user', 'content': 'Hi'}]}); "
        "print(ids, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # <|im_start|>system\n(the template's default system prompt)<|im_end|>\n<|im_start|>user\nHi ...
    expected = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]
    expected += [407, 19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]
    assert out.stdout.strip() == f"{expected} []"
