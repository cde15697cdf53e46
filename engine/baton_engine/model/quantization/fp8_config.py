"""FP8 checkpoint configurations: the ``quantization_config`` of config.json -> which layers are
FP8 and how, for the two formats deployments use.

``"quant_method": "fp8"`` (vLLM's and AutoFP8's format): every linear layer not listed in
``ignored_layers`` (or ``modules_to_not_convert``) is FP8 with one weight scale per tensor
(``weight_scale``, a scalar); ``activation_scheme`` is ``static`` (a calibrated ``input_scale``
per layer) or ``dynamic``. Block-wise scales (``weight_block_size``) are refused.

``"quant_method": "compressed-tensors"`` (llm-compressor's format, ``"format": "float-quantized"``
or ``"naive-quantized"``): ``config_groups`` map ``targets`` (``"Linear"``, module names or
``re:`` patterns) to a scheme: ``weights`` 8-bit float, ``strategy`` ``tensor`` (scale [1]) or
``channel`` (scale [out, 1]); ``input_activations`` absent (weight-only), ``strategy: tensor``
with ``dynamic: false`` (static ``input_scale``) or ``dynamic: true`` (computed per token at run
time; a dynamic per-tensor scheme is run per token too: finer, never coarser). ``ignore`` lists
names or ``re:`` patterns left in 16 bits. ``kv_cache_scheme`` says the checkpoint carries a
``k_scale`` and a ``v_scale`` per attention layer for an FP8 KV cache.

Names are the checkpoint's module names (``model.layers.0.self_attn.q_proj``, Mixtral's
``block_sparse_moe.experts.3.w1``), so patterns written for the checkpoint match as written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from baton_engine.model.quantization.fp8 import ActivationScheme

WeightStrategy = Literal["tensor", "channel"]
CheckpointFormat = Literal["fp8", "compressed-tensors"]

_COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization_config describes something this engine cannot run."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How the layers of one group are stored."""

    weight_strategy: WeightStrategy
    """One weight scale per tensor, or one per output channel."""
    activation: ActivationScheme
    """How activations are quantized when the layer runs."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """The FP8 layout of a checkpoint."""

    format: CheckpointFormat
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    """(targets, scheme) in the config's order: ``"Linear"``, module names or ``re:`` patterns."""
    ignore: tuple[str, ...]
    """Module names (or ``re:`` patterns) kept in 16 bits."""
    kv_cache_scales: bool = False
    """The checkpoint holds per-layer ``k_scale`` / ``v_scale`` for an FP8 KV cache."""

    def scheme_for(self, module: str) -> Fp8Scheme | None:
        """The scheme of linear layer `module` (a checkpoint module name); None: 16-bit."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(target == "Linear" or _matches(target, module) for target in targets):
                return scheme
        return None

    def merged_scheme(self, parts: Sequence[str]) -> Fp8Scheme | None:
        """The scheme of a layer merged from checkpoint modules `parts` (q/k/v, gate/up): they
        must agree, since one merged weight has one dtype."""
        schemes = {part: self.scheme_for(part) for part in parts}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            listed = ", ".join(f"{p}: {'16-bit' if s is None else s}" for p, s in schemes.items())
            raise UnsupportedQuantizationError(
                f"quantization_config: the parts of one merged layer are quantized differently ({listed})"
            )
        return distinct.pop()


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def parse_quantization_config(raw: dict[str, Any] | None) -> Fp8Checkpoint | None:
    """The FP8 layout described by config.json's ``quantization_config`` (None: not quantized).

    Raises `UnsupportedQuantizationError` naming the key that cannot be served.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedQuantizationError("quantization_config: must be an object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    raise UnsupportedQuantizationError(
        f"quantization_config.quant_method: {method!r} is not supported (supported: fp8, compressed-tensors)"
    )


def _parse_fp8(raw: dict[str, Any]) -> Fp8Checkpoint:
    if raw.get("weight_block_size") is not None:
        raise UnsupportedQuantizationError(
            "quantization_config.weight_block_size: block-wise FP8 scales are not supported "
            "(per-tensor and per-channel are)"
        )
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(f"quantization_config.fmt: {fmt!r} is not supported (e4m3 is)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise UnsupportedQuantizationError(
            f"quantization_config.activation_scheme: {scheme!r} is not static or dynamic"
        )
    ignored = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    return Fp8Checkpoint(
        format="fp8",
        groups=((("Linear",), Fp8Scheme("tensor", scheme)),),
        ignore=tuple(str(name) for name in ignored),
    )


def _parse_compressed_tensors(raw: dict[str, Any]) -> Fp8Checkpoint:
    fmt = raw.get("format")
    if fmt not in _COMPRESSED_FORMATS:
        supported = ", ".join(_COMPRESSED_FORMATS)
        raise UnsupportedQuantizationError(
            f"quantization_config.format: {fmt!r} is not supported (supported: {supported})"
        )
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise UnsupportedQuantizationError("quantization_config.config_groups: must be a non-empty object")
    groups: list[tuple[tuple[str, ...], Fp8Scheme]] = []
    for name, group in groups_raw.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise UnsupportedQuantizationError(f"{where}: must be an object")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise UnsupportedQuantizationError(f"{where}.targets: must be a non-empty list")
        groups.append((tuple(str(t) for t in targets), _group_scheme(group, where)))
    kv_scheme = raw.get("kv_cache_scheme")
    if kv_scheme is not None:
        _check_float8(kv_scheme, "quantization_config.kv_cache_scheme")
        if kv_scheme.get("strategy", "tensor") != "tensor" or kv_scheme.get("dynamic", False):
            raise UnsupportedQuantizationError(
                "quantization_config.kv_cache_scheme: only static per-tensor KV scales are supported"
            )
    return Fp8Checkpoint(
        format="compressed-tensors",
        groups=tuple(groups),
        ignore=tuple(str(name) for name in raw.get("ignore") or []),
        kv_cache_scales=kv_scheme is not None,
    )


def _check_float8(args: Any, where: str) -> None:
    if not isinstance(args, dict):
        raise UnsupportedQuantizationError(f"{where}: must be an object")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise UnsupportedQuantizationError(
            f"{where}: only 8-bit float (FP8) is supported, got num_bits={args.get('num_bits')!r} "
            f"type={args.get('type')!r}"
        )
    if args.get("symmetric", True) is not True:
        raise UnsupportedQuantizationError(f"{where}.symmetric: only symmetric FP8 is supported")


def _group_scheme(group: dict[str, Any], where: str) -> Fp8Scheme:
    weights = group.get("weights")
    _check_float8(weights, f"{where}.weights")
    assert isinstance(weights, dict)
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel"):
        raise UnsupportedQuantizationError(
            f"{where}.weights.strategy: {strategy!r} is not supported (supported: tensor, channel)"
        )
    if weights.get("dynamic", False):
        raise UnsupportedQuantizationError(f"{where}.weights.dynamic: weights must have static scales")
    activations = group.get("input_activations")
    if activations is None:
        return Fp8Scheme(strategy, "none")
    _check_float8(activations, f"{where}.input_activations")
    if activations.get("dynamic", False):
        return Fp8Scheme(strategy, "dynamic")
    if activations.get("strategy", "tensor") != "tensor":
        raise UnsupportedQuantizationError(
            f"{where}.input_activations.strategy: static activation scales must be per tensor, got "
            f"{activations.get('strategy')!r}"
        )
    return Fp8Scheme(strategy, "static")
