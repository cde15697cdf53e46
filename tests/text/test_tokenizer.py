"""Tokenizer loading from a Hugging Face directory, chat template rendering and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from baton_engine.model.loader.gguf_loader import open_gguf
from baton_engine.model.loader.gguf_tokenizer import tokenizer_from_gguf
from baton_engine.model.loader.reference import resolve_model
from baton_engine.text.chat_template import ChatTemplateError, render_chat
from baton_engine.text.tokenizer import Tokenizer

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hello there!  "},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    return tokenizer_from_gguf(open_gguf(resolve_model("builtin:smollm2-135m-instruct").path))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> Path:
    """A transformers-style tokenizer directory: tokenizer.json + tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("tok")
    smollm2_tokenizer.backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": LLAMA3_STYLE_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_directory_tokenizer_matches_transformers(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained_dir(hf_dir)
    assert ours is not None
    theirs: Any = AutoTokenizer.from_pretrained(hf_dir)
    for text in ["Hello world", "naïve café 日本", "x = [1, 22, 333]\n"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.render_chat(MESSAGES, add_generation_prompt) == expected
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == (2,)
    assert ours.render_chat(MESSAGES).startswith("<|im_start|><|start|>system\nBe brief.<|eot|>")


def test_named_templates_and_jinja_file(hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok is not None and tok.chat_template == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("FROM FILE")
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok is not None and tok.chat_template == "FROM FILE"


def test_directory_without_tokenizer_json_has_no_tokenizer(tmp_path: Path) -> None:
    assert Tokenizer.from_pretrained_dir(tmp_path) is None


def test_template_errors_are_chat_template_errors(smollm2_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat("{% for %}", MESSAGES)
    bare = Tokenizer(backend=smollm2_tokenizer.backend, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.encode_chat(MESSAGES)


def test_template_sandbox_refuses_attribute_escape() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", MESSAGES)


def test_tojson_filter_keeps_unicode() -> None:
    assert render_chat("{{ messages[0] | tojson }}", [{"role": "user", "content": "日本"}]) == (
        '{"role": "user", "content": "日本"}'
    )
