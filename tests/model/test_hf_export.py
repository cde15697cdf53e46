"""GGUF -> Hugging Face folder export: what transformers (and so vLLM) loads is Baton's model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from baton_engine.cli import main as cli_main
from baton_engine.model.loader.gguf_loader import open_gguf, read_config, read_weights
from baton_engine.model.loader.hf_export import STAMP_FILE, ExportError, export_hf_folder
from baton_engine.model.loader.model_loading import load_model
from baton_support.tiny_models import parity_model
from tests.model.test_gguf_roundtrip import _write_gguf

PROMPT = [5, 17, 200, 33, 101, 250, 7, 64]


def _tiny_gguf(family: str, tmp_path: Path, **kwargs: Any) -> tuple[torch.nn.Module, Path]:
    model = parity_model(family, seed=11).save(tmp_path / "hf")
    _write_gguf(model, family, tmp_path / "tiny.gguf", **kwargs)
    return model, tmp_path / "tiny.gguf"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_transformers_runs_the_exported_folder_like_the_gguf(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, gguf = _tiny_gguf(family, tmp_path)
    folder = export_hf_folder(str(gguf), tmp_path / "export")

    exported = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert exported.dtype == torch.float32
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"):
        assert getattr(exported.config, key) == getattr(original.config, key), key
    head_dim = getattr(original.config, "head_dim", None) or 64 // original.config.num_attention_heads
    assert exported.config.head_dim == head_dim
    assert exported.config.rope_parameters["rope_theta"] == original.config.rope_parameters["rope_theta"]
    # The tiny Llama's llama3 rope is left out of its GGUF here (no rope_freqs): plain rope.
    assert exported.config.rope_parameters["rope_type"] == "default"
    assert exported.config.tie_word_embeddings == original.config.tie_word_embeddings
    # The GGUF holds the weights in float32, down_proj in float16: the reference is rounded alike.
    reference = parity_model(family, seed=11).save(tmp_path / "hf2").to(torch.float32)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                param.copy_(param.to(torch.float16).to(torch.float32))
    expected_state = reference.state_dict()
    got_state = exported.state_dict()
    assert got_state.keys() == expected_state.keys()
    for name, value in expected_state.items():
        assert torch.equal(got_state[name], value), name
    if family != "llama":
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=0, atol=0)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert tokenizer("abc", add_special_tokens=False)["input_ids"] == [len(alphabet), alphabet.index("c")]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_baton_loads_the_exported_folder_as_the_gguf(family: str, tmp_path: Path) -> None:
    _, gguf = _tiny_gguf(family, tmp_path)
    folder = export_hf_folder(str(gguf), tmp_path / "export")
    from_gguf = load_model(str(gguf), "cpu", torch.float32)
    from_folder = load_model(str(folder), "cpu", torch.float32)
    assert (from_folder.source.format, from_gguf.source.format) == ("safetensors", "gguf")
    # config.json carries the float32 eps of the GGUF as its shortest decimal (1e-06, not 9.99...e-07).
    assert from_folder.config.rms_norm_eps == 1e-6
    assert np.float32(from_folder.config.rms_norm_eps) == np.float32(from_gguf.config.rms_norm_eps)
    assert from_folder.config == dataclasses.replace(
        from_gguf.config, name=from_folder.config.name, rms_norm_eps=from_folder.config.rms_norm_eps
    )
    expected = from_gguf.model.state_dict()
    got = from_folder.model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert from_folder.tokenizer is not None and from_gguf.tokenizer is not None
    assert from_folder.tokenizer.encode("abcab") == from_gguf.tokenizer.encode("abcab")
    assert from_folder.tokenizer.eos_token_ids == from_gguf.tokenizer.eos_token_ids
    assert from_folder.tokenizer.special_ids == from_gguf.tokenizer.special_ids


def test_bfloat16_export_halves_the_weights(tmp_path: Path) -> None:
    _, gguf = _tiny_gguf("qwen2", tmp_path)
    folder = export_hf_folder(str(gguf), tmp_path / "export", "bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reader = open_gguf(gguf)
    source = read_weights(reader, read_config(reader))
    assert weights.keys() == source.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[name], source[name].to(torch.bfloat16))


def test_rerun_keeps_the_export_and_other_folders_are_refused(tmp_path: Path) -> None:
    _, gguf = _tiny_gguf("qwen2", tmp_path)
    folder = export_hf_folder(str(gguf), tmp_path / "export")
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert sorted(written) == [
        STAMP_FILE,
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert export_hf_folder(str(gguf), folder) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written

    with pytest.raises(
        ExportError, match=r"^output: .*bf16 exists and is not an export of .*tiny\.gguf \(bfloat16\)"
    ):
        (tmp_path / "bf16").mkdir()
        (tmp_path / "bf16" / "notes.txt").write_text("mine")
        export_hf_folder(str(gguf), tmp_path / "bf16", "bfloat16")
    assert [p.name for p in (tmp_path / "bf16").iterdir()] == ["notes.txt"]
    # A different dtype is another export: never written over this one.
    with pytest.raises(ExportError, match="is not an export of"):
        export_hf_folder(str(gguf), folder, "bfloat16")
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    # An empty folder is filled; nothing is left beside it.
    (tmp_path / "empty").mkdir()
    export_hf_folder(str(gguf), tmp_path / "empty")
    assert (tmp_path / "empty" / STAMP_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_same_model_from_another_checkout_is_the_same_export_and_old_formats_are_replaced(
    tmp_path: Path,
) -> None:
    """The export is named by the source's content: the same GGUF installed in another checkout
    (another path, another mtime) keeps the shared export; a folder of an earlier export format
    (Baton's own stamp, format 1: path + mtime) is rewritten in the current one."""
    _, gguf = _tiny_gguf("qwen2", tmp_path)
    folder = export_hf_folder(str(gguf), tmp_path / "export")
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    elsewhere = tmp_path / "other-checkout" / gguf.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(gguf.read_bytes())
    assert export_hf_folder(str(elsewhere), folder) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written

    old = {"format": 1, "source": str(elsewhere), "source_size": 1, "source_mtime_ns": 1, "dtype": "float32"}
    (folder / STAMP_FILE).write_text(json.dumps(old))
    export_hf_folder(str(gguf), folder)
    stamp = json.loads((folder / STAMP_FILE).read_text())
    assert stamp["format"] == 2
    assert stamp["source_name"] == gguf.name
    assert stamp["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_llama31_frequency_factors_are_refused(tmp_path: Path) -> None:
    model = parity_model("llama", seed=3).save(tmp_path / "hf")
    factors = torch.linspace(1.0, 8.0, 16).numpy()
    _write_gguf(model, "llama", tmp_path / "tiny.gguf", factors)
    with pytest.raises(ExportError, match=r"^rope_scaling: per-frequency factors .* no config\.json form$"):
        export_hf_folder(str(tmp_path / "tiny.gguf"), tmp_path / "export")
    assert not (tmp_path / "export").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, gguf = _tiny_gguf("qwen3", tmp_path)
    assert cli_main(["export", "--model", str(gguf), "--output", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out'}\n"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--model", str(tmp_path / "out"), "--output", str(tmp_path / "again")])
    assert exit_info.value.code == 2
    assert "only GGUF models are exported" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_export_tokenizes_like_baton_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = export_hf_folder("builtin:smollm2-135m-instruct", tmp_path / "smollm2")
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["eos_token_id"]) == (30, 3, 2)
    from baton_engine.model.loader.tokenizer_loading import load_tokenizer

    baton = load_tokenizer("builtin:smollm2-135m-instruct")
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in (
        "In 2024, café 日本語 🎉",
        "def f(x):\n    return x * 2\n",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert theirs(text)["input_ids"] == baton.encode(text), text
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == baton.render_chat(messages, True)
    assert theirs.eos_token == "<|im_end|>"
