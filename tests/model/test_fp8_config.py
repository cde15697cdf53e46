"""config.json quantization_config -> which layers are FP8 and how (both checkpoint formats)."""

from __future__ import annotations

from typing import Any

import pytest

from baton_engine.model.quantization.fp8_config import (
    Fp8Scheme,
    UnsupportedQuantizationError,
    parse_quantization_config,
)

Q = "model.layers.0.self_attn.q_proj"


def _compressed(weights: dict[str, Any], activations: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        **extra,
    }


FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True}


def test_no_config_is_16_bit() -> None:
    assert parse_quantization_config(None) is None


@pytest.mark.parametrize(("activation_scheme", "expected"), [("static", "static"), ("dynamic", "dynamic")])
def test_fp8_format(activation_scheme: str, expected: str) -> None:
    ckpt = parse_quantization_config(
        {"quant_method": "fp8", "activation_scheme": activation_scheme, "ignored_layers": ["lm_head"]}
    )
    assert ckpt is not None and ckpt.format == "fp8"
    assert ckpt.scheme_for(Q) == Fp8Scheme("tensor", expected)  # type: ignore[arg-type]
    assert ckpt.scheme_for("lm_head") is None


@pytest.mark.parametrize(
    ("weights", "activations", "expected"),
    [
        ({**FLOAT8, "strategy": "channel", "dynamic": False},
         {**FLOAT8, "strategy": "token", "dynamic": True}, Fp8Scheme("channel", "dynamic")),
        ({**FLOAT8, "strategy": "tensor", "dynamic": False},
         {**FLOAT8, "strategy": "tensor", "dynamic": False}, Fp8Scheme("tensor", "static")),
        ({**FLOAT8, "strategy": "tensor"},
         {**FLOAT8, "strategy": "tensor", "dynamic": True}, Fp8Scheme("tensor", "dynamic")),
        ({**FLOAT8, "strategy": "channel"}, None, Fp8Scheme("channel", "none")),
    ],
    ids=["fp8-dynamic", "static", "dynamic-per-tensor-run-per-token", "weight-only"],
)  # fmt: skip
def test_compressed_tensors_schemes(
    weights: dict[str, Any], activations: dict[str, Any] | None, expected: Fp8Scheme
) -> None:
    ckpt = parse_quantization_config(_compressed(weights, activations))
    assert ckpt is not None and ckpt.format == "compressed-tensors"
    assert ckpt.scheme_for(Q) == expected
    assert ckpt.scheme_for("model.layers.0.mlp.experts.3.gate_proj") == expected
    assert ckpt.scheme_for("model.layers.0.mlp.gate") is None  # re:.*mlp.gate$
    assert ckpt.scheme_for("lm_head") is None
    assert ckpt.kv_cache_scales is False


def test_kv_cache_scheme_and_named_targets() -> None:
    raw = _compressed(
        {**FLOAT8, "strategy": "tensor"},
        None,
        kv_cache_scheme={**FLOAT8, "strategy": "tensor", "dynamic": False},
    )
    raw["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    ckpt = parse_quantization_config(raw)
    assert ckpt is not None and ckpt.kv_cache_scales is True
    assert ckpt.scheme_for(Q) == Fp8Scheme("tensor", "none")
    assert ckpt.scheme_for("model.layers.0.mlp.down_proj") is None  # not a target


def test_merged_parts_must_agree() -> None:
    ckpt = parse_quantization_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [Q]}
    )
    assert ckpt is not None
    parts = [Q, Q.replace("q_proj", "k_proj"), Q.replace("q_proj", "v_proj")]
    with pytest.raises(
        UnsupportedQuantizationError, match="parts of one merged layer are quantized differently"
    ):
        ckpt.merged_scheme(parts)
    assert ckpt.merged_scheme(parts[1:]) == Fp8Scheme("tensor", "dynamic")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method: 'awq' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]},
         "quantization_config.weight_block_size: block-wise FP8 scales are not supported"),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"},
         "quantization_config.activation_scheme: 'sometimes' is not static or dynamic"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2' is not supported"),
        (_compressed({"num_bits": 8, "type": "int", "strategy": "channel"}, None),
         "config_groups.group_0.weights: only 8-bit float \\(FP8\\) is supported, got num_bits=8 type='int'"),
        (_compressed({**FLOAT8, "strategy": "group", "group_size": 128}, None),
         "config_groups.group_0.weights.strategy: 'group' is not supported"),
        (_compressed({**FLOAT8, "strategy": "tensor"}, {**FLOAT8, "strategy": "token", "dynamic": False}),
         "input_activations.strategy: static activation scales must be per tensor, got 'token'"),
        ({**_compressed({**FLOAT8}, None), "format": "pack-quantized"},
         "quantization_config.format: 'pack-quantized' is not supported"),
    ],
    ids=["method", "block", "activation", "e5m2", "int8", "group", "static-token", "packed"],
)  # fmt: skip
def test_unsupported_configs_are_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=message):
        parse_quantization_config(raw)
