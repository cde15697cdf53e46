"""GGUF files (llama.cpp): hyper-parameters from metadata, tensors dequantized with `gguf`.

`gguf` is imported here only, so the rest of the engine runs without it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from baton_engine.model.config import ModelConfig, ModelFamily, UnsupportedArchitectureError
from baton_engine.model.loader.gguf_file import open_gguf as open_gguf  # re-exported

GGUF_ARCHITECTURES: dict[str, ModelFamily] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata (large arrays such as the vocabulary are read separately)."""
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token",
        ):
            continue
        values[key] = field.contents()
    return values


def read_config(reader: Any, name: str = "") -> ModelConfig:
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    family = GGUF_ARCHITECTURES.get(str(arch))
    if family is None:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise UnsupportedArchitectureError(f"GGUF rope scaling {scaling_type!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1 scaling, precomputed per frequency by llama.cpp
        factors = tuple(float(x) for x in np.asarray(freqs.data, dtype=np.float32).reshape(-1))
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    has_qkv_bias = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    has_o_bias = any(t.name == "blk.0.attn_output.bias" for t in reader.tensors)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=not has_output,
        qkv_bias=has_qkv_bias,
        o_bias=has_o_bias,
        qk_norm=family == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name or str(meta.get("general.name", "")),
    )


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rows(weight: npt.NDArray[Any], num_heads: int) -> npt.NDArray[Any]:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> half-split halves).

    The converter reorders each head's rows from [first half, second half] to interleaved pairs;
    regrouping the rows of every head as (pairs, 2) and transposing restores the original order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    restored = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return restored.reshape(weight.shape)


class GgufSource:
    """One GGUF tensor, dequantized only as far as a read asks (Hugging Face layout and names).

    GGUF stores a matrix row by row, each row quantized in blocks along it, so a slice of rows
    dequantizes only those rows, and a slice of columns on block boundaries only those blocks.
    Llama's q/k rows are un-permuted per head after the read (reads of them must be whole heads).
    """

    def __init__(self, tensor: Any, unpermute_head_rows: int | None) -> None:
        self.tensor = tensor
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        self.unpermute_head_rows = unpermute_head_rows
        """Rows per head of a llama q/k projection (None: no permutation to undo)."""

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        kind = self.tensor.tensor_type
        rows = index[0] if index else slice(0, self.shape[0])
        if len(self.shape) == 1:
            data = self.tensor.data
            full = data if kind == GGMLQuantizationType.F32 else dequantize(data, kind)
            array = np.asarray(full, dtype=np.float32).reshape(-1)[rows]
        else:
            cols = index[1] if len(index) > 1 else slice(0, self.shape[1])
            # F32: float32 [rows, cols]; quantized: uint8 [rows, bytes per row]; F16/BF16: typed.
            raw = self.tensor.data.reshape(self.shape[0], -1)[rows]
            if kind == GGMLQuantizationType.F32:
                array = np.asarray(raw, dtype=np.float32)[:, cols]
            else:
                block, block_bytes = GGML_QUANT_SIZES[kind]
                on_blocks = cols.start % block == 0 and (cols.stop % block == 0 or cols.stop == self.shape[1])
                if raw.dtype == np.uint8 and on_blocks:  # dequantize just the blocks of `cols`
                    raw = raw[:, cols.start // block * block_bytes : -(-cols.stop // block) * block_bytes]
                    array = dequantize(raw, kind).reshape(raw.shape[0], -1)
                else:
                    array = dequantize(raw, kind).reshape(raw.shape[0], -1)[:, cols]
        if self.unpermute_head_rows is not None:
            heads, rest = divmod(array.shape[0], self.unpermute_head_rows)
            if rest or rows.start % self.unpermute_head_rows:
                raise ValueError(f"{self.tensor.name}: a read of q/k rows must cover whole heads")
            array = unpermute_rows(array, heads)
        # Copy: memory-mapped F32 tensors are read-only views of the file.
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def weight_sources(reader: Any, config: ModelConfig) -> list[tuple[str, GgufSource]]:
    """Every model tensor as a lazily dequantized source, by Hugging Face name."""
    sources: list[tuple[str, GgufSource]] = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        permuted = config.family == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
        sources.append((name, GgufSource(tensor, config.head_dim if permuted else None)))
    return sources


def read_weights(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All model tensors in float32 (quantized ones dequantized), Hugging Face names and layout."""
    return {name: source.read() for name, source in weight_sources(reader, config)}
