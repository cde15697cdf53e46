"""A GGUF model written out as a Hugging Face folder (config.json, safetensors, tokenizer files).

Other engines (vLLM, transformers) then load exactly the weights and the tokenizer Baton runs:
the tensors Baton dequantizes from the GGUF and the tokenizer Baton rebuilds from its metadata
(transformers' own GGUF converter drops the pre-tokenizer's digit split that SmolLM2 uses).
The folder loads back into Baton as a safetensors model with the same config and weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.loader.reference import resolve_model
from baton_engine.text.tokenizer import Tokenizer

ExportDtype = Literal["float32", "bfloat16", "float16"]

#: Written last into every finished export: what it was made from (a re-run with the same source
#: and dtype finds it and returns at once; anything else is never overwritten).
STAMP_FILE = "baton-export.json"
#: Bumped whenever the files written change, so that older exports are recognised as stale.
EXPORT_FORMAT = 2

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ExportError(ValueError):
    """The model cannot be exported, or the output folder holds something else."""


def _float32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_config(config: ModelConfig, dtype: ExportDtype) -> dict[str, Any]:
    """config.json for `config` in transformers 5's form (plus the pre-5 rope keys)."""
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    if rope_type == "freq_factors":
        raise ExportError(
            "rope_scaling: per-frequency factors from a GGUF rope_freqs tensor have no config.json form"
        )
    rope_parameters: dict[str, Any] = {"rope_type": "default", **(config.rope_scaling or {})}
    rope_theta = _float32_decimal(config.rope_theta)
    rope_parameters["rope_theta"] = rope_theta
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_decimal(config.rms_norm_eps),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope_parameters,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_type == "default" else config.rope_scaling,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids)
        if len(config.eos_token_ids) > 1
        else next(iter(config.eos_token_ids), None),
        "dtype": dtype,
    }
    if config.family == "llama":
        if config.qkv_bias != config.o_bias:
            raise ExportError(
                "attention_bias: Llama's config.json cannot express a Q/K/V bias without an O bias"
            )
        raw["attention_bias"] = config.qkv_bias
        raw["mlp_bias"] = config.mlp_bias
    return raw


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens and chat template beside tokenizer.json."""
    raw: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, key)
        if value is not None:
            raw[key] = value
    if tokenizer.chat_template is not None:
        raw["chat_template"] = tokenizer.chat_template
    return raw


def _source_stamp(path: Path, dtype: ExportDtype) -> dict[str, Any]:
    # The source is named by its content, not its path: the same package installed in another
    # checkout's virtual environment is the same model, and its export is shared.
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return {
        "format": EXPORT_FORMAT,
        "source_name": path.name,
        "source_sha256": digest.hexdigest(),
        "dtype": dtype,
    }


def _is_outdated_export(stamp_path: Path) -> bool:
    """True for a folder written by an earlier export format: Baton's own, safe to replace."""
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict) and isinstance(stamp.get("format"), int) and stamp["format"] < EXPORT_FORMAT
    )


def export_hf_folder(reference: str, output: Path, dtype: ExportDtype = "float32") -> Path:
    """Write the GGUF model `reference` to `output` as a Hugging Face folder; returns `output`.

    Idempotent: an `output` already holding this export (a source of the same content, the same
    dtype) is kept as it is; one written by an earlier export format is replaced. A non-empty
    `output` holding anything else is refused, never overwritten. The folder appears whole or not
    at all (written beside it, then renamed).
    """
    from safetensors.torch import save_file

    from baton_engine.model.loader import gguf_loader
    from baton_engine.model.loader.gguf_tokenizer import tokenizer_from_gguf

    resolved = resolve_model(reference)
    if resolved.format != "gguf":
        raise ExportError(f"{reference}: only GGUF models are exported ({resolved.path} is already a folder)")
    stamp = _source_stamp(resolved.path, dtype)
    output = output.expanduser()
    stamp_path = output / STAMP_FILE
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return output
    outdated = stamp_path.is_file() and _is_outdated_export(stamp_path)
    if not outdated and output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"output: {output} exists and is not an export of {resolved.path} ({dtype})")

    reader = gguf_loader.open_gguf(resolved.path)
    config = gguf_loader.read_config(reader, resolved.name)
    config_json = hf_config(config, dtype)
    tokenizer = tokenizer_from_gguf(reader)
    torch_dtype = getattr(torch, dtype)
    weights = {
        name: tensor.to(torch_dtype).contiguous()
        for name, tensor in gguf_loader.read_weights(reader, config).items()
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; an export is for other programs to read
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (staging / "generation_config.json").write_text(
            json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config_json["eos_token_id"]})
            + "\n"
        )
        tokenizer.backend.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(tokenizer), indent=2) + "\n"
        )
        (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        if outdated:
            shutil.rmtree(output)
        elif output.is_dir():
            output.rmdir()  # empty (checked above)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output
