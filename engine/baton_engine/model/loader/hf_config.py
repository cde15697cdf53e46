"""Hugging Face config.json -> `ModelConfig`."""

from __future__ import annotations

from typing import Any

from baton_engine.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelFamily,
    MoeConfig,
    UnsupportedArchitectureError,
)


def model_config_from_hf(raw: dict[str, Any], name: str = "") -> ModelConfig:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise UnsupportedArchitectureError("config.json names no architecture (`architectures` is empty)")
    architecture = architectures[0]
    family = SUPPORTED_ARCHITECTURES.get(architecture)
    if family is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    if raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{architecture} with use_sliding_window=true is not supported")
    if family == "mixtral" and raw.get("sliding_window") is not None:
        raise UnsupportedArchitectureError(
            f"{architecture} with sliding_window={raw['sliding_window']} is not supported (null is)"
        )
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        moe=_moe(raw, family),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
    )


def _moe(raw: dict[str, Any], family: ModelFamily) -> MoeConfig | None:
    """The MoE layers, by transformers' rules: Qwen3-MoE layer i is sparse unless it is in
    `mlp_only_layers`, when experts exist and (i + 1) is a multiple of `decoder_sparse_step`;
    every Mixtral layer is sparse, its experts `intermediate_size` wide, top-k always renormalised."""
    layers = int(raw["num_hidden_layers"])
    if family == "qwen3_moe":
        # transformers 5 writes num_local_experts; Qwen's own configs say num_experts.
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        if not sparse:
            return None
        return MoeConfig(
            num_experts=experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routing_in_float32=False,
            sparse_layers=sparse,
        )
    if family == "mixtral":
        return MoeConfig(
            num_experts=int(raw["num_local_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            routing_in_float32=True,
            sparse_layers=tuple(range(layers)),
        )
    return None


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    return theta, (None if rope_type == "default" else scaling)
