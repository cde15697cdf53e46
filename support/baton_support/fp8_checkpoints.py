"""FP8 checkpoints made from a 16-bit Hugging Face folder, in the two formats deployments use.

`write_fp8_checkpoint(source, target, ...)` quantizes every linear layer of the decoder (the
attention and MLP projections, experts included; not the embeddings, the LM head or an MoE
router) with the engine's own numerics (`quantization.fp8`), and writes the tensors and the
``quantization_config`` under exactly the keys each format uses:

* ``fmt="fp8"`` (vLLM's and AutoFP8's): ``X.weight`` float8_e4m3fn, ``X.weight_scale`` a
  scalar, ``X.input_scale`` a scalar (static activations);
  ``{"quant_method": "fp8", "activation_scheme": ..., "ignored_layers": [...]}``.
* ``fmt="compressed-tensors"`` (llm-compressor's ``float-quantized``): ``X.weight_scale`` [1]
  (tensor) or [out, 1] (channel), ``X.input_scale`` [1]; one config group targeting ``Linear``
  with its ``weights`` / ``input_activations`` arguments, an ``ignore`` list, and with
  ``kv_cache_scales`` a ``kv_cache_scheme`` plus ``self_attn.k_scale`` / ``v_scale`` per layer.

Static scales are calibrated on `calibration` prompts run through transformers: a layer's
``input_scale`` is its largest input magnitude over 448; a layer's K (after its norm and rotary
embedding, as the KV cache stores it) and V give ``k_scale`` and ``v_scale`` the same way.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import torch

CheckpointFormat = Literal["fp8", "compressed-tensors"]

#: Linear layers of the decoder in checkpoint names (dense, Qwen3-MoE and Mixtral experts).
_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])$"
)
_E4M3_MAX = 448.0


def _calibrate(
    source: Path, calibration: list[list[int]]
) -> tuple[dict[str, float], dict[int, tuple[float, float]]]:
    """(input amax per linear module, (K amax, V amax) per layer) over the prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    inputs: dict[str, float] = defaultdict(float)
    kv: dict[int, tuple[float, float]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and _LINEAR.match(name):

            def record(mod: Any, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                inputs[name] = max(inputs[name], float(args[0].abs().max()))

            hooks.append(module.register_forward_pre_hook(record))
        if name.endswith("self_attn") and hasattr(module, "k_proj"):
            layer = int(name.split(".")[2])

            def record_kv(
                mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int = layer
            ) -> None:
                from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

                hidden = kwargs.get("hidden_states", args[0] if args else None)
                assert hidden is not None
                shape = (*hidden.shape[:-1], -1, mod.head_dim)
                k = mod.k_proj(hidden).view(shape)
                if getattr(mod, "k_norm", None) is not None:
                    k = mod.k_norm(k)
                cos, sin = kwargs["position_embeddings"]
                _, k = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
                v = mod.v_proj(hidden)
                k_max, v_max = kv.get(layer, (0.0, 0.0))
                kv[layer] = (max(k_max, float(k.abs().max())), max(v_max, float(v.abs().max())))

            hooks.append(module.register_forward_pre_hook(record_kv, with_kwargs=True))
    with torch.no_grad():
        for prompt in calibration:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return dict(inputs), kv


def write_fp8_checkpoint(
    source: Path,
    target: Path,
    fmt: CheckpointFormat,
    *,
    weight_strategy: Literal["tensor", "channel"] = "tensor",
    activation: Literal["static", "dynamic", "none"] = "dynamic",
    calibration: list[list[int]] | None = None,
    kv_cache_scales: bool = False,
) -> Path:
    """Write `source` (a 16-bit Hugging Face folder) as an FP8 checkpoint at `target`."""
    from safetensors.torch import load_file, save_file

    from baton_engine.model.quantization.fp8 import quantize_weight

    if fmt == "fp8" and (weight_strategy != "tensor" or activation == "none" or kv_cache_scales):
        raise ValueError("fmt fp8: per-tensor weight scales, static or dynamic activations, no KV scales")
    needs_calibration = activation == "static" or kv_cache_scales
    if needs_calibration and not calibration:
        raise ValueError("static activation or KV scales need calibration prompts")
    amax, kv = _calibrate(source, calibration or []) if needs_calibration else ({}, {})
    target.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and _LINEAR.match(module)):
            written[name] = tensor.contiguous()
            continue
        q, scale = quantize_weight(tensor, torch.float8_e4m3fn, per_channel=weight_strategy == "channel")
        written[name] = q
        if fmt == "fp8":
            written[f"{module}.weight_scale"] = scale.reshape(())
        else:
            written[f"{module}.weight_scale"] = (
                scale.reshape(-1, 1) if weight_strategy == "channel" else scale.reshape(1)
            )
        if activation == "static":
            input_scale = torch.tensor(max(amax[module], 1e-12) / _E4M3_MAX)
            written[f"{module}.input_scale"] = input_scale.reshape(() if fmt == "fp8" else (1,))
    for layer, (k_max, v_max) in kv.items():
        prefix = f"model.layers.{layer}.self_attn."
        written[prefix + "k_scale"] = torch.tensor([max(k_max, 1e-12) / _E4M3_MAX])
        written[prefix + "v_scale"] = torch.tensor([max(v_max, 1e-12) / _E4M3_MAX])
    save_file(written, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, weight_strategy, activation, kv_cache_scales)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():
        if extra.name not in ("config.json",) and extra.suffix != ".safetensors" and extra.is_file():
            shutil.copy(extra, target / extra.name)
    return target


def _quantization_config(
    fmt: CheckpointFormat, weight_strategy: str, activation: str, kv_cache_scales: bool
) -> dict[str, Any]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activation, "ignored_layers": ["lm_head"]}
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "actorder": None}
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": {**float8, "strategy": weight_strategy, "dynamic": False, "observer": "minmax"},
        "input_activations": None,
        "output_activations": None,
    }
    if activation == "static":
        group["input_activations"] = {**float8, "strategy": "tensor", "dynamic": False, "observer": "minmax"}
    elif activation == "dynamic":
        group["input_activations"] = {**float8, "strategy": "token", "dynamic": True, "observer": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
        "kv_cache_scheme": (
            {**float8, "strategy": "tensor", "dynamic": False, "observer": "minmax"}
            if kv_cache_scales
            else None
        ),
        "global_compression_ratio": None,
    }
