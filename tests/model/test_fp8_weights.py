"""FP8 weights on the CPU: checkpoints in both formats (written here by the engine's own
quantization) load with exactly their stored values and compute what their scheme prescribes;
16-bit checkpoints quantize on load; unsupported configurations are refused naming the key."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from baton_engine.model.linear import ParallelLinear
from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.quantization import fp8
from baton_engine.model.quantization.fp8_config import UnsupportedQuantizationError
from baton_support.fp8_checkpoints import write_fp8_checkpoint
from baton_support.tiny_models import PARITY
from tests.model.driver import prefill_logits

VOCAB = PARITY.vocab_size
FMT = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-qwen3-16bit")
    model = PARITY.replace(family="qwen3", llama3_rope=False, dtype="float32", seed=6).save(directory)
    return directory, model


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(count)]


def _hf_fp8_reference(hf: Any, checkpoint: Path, activation: str) -> None:
    """Turn transformers' model into the scheme's arithmetic: each FP8 linear's weight becomes
    its stored value times its scale, and its input is quantized and dequantized as prescribed."""
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, module in hf.named_modules():
        if f"{name}.weight_scale" not in tensors:
            continue
        scale = tensors[f"{name}.weight_scale"].reshape(-1)
        module.weight.data = fp8.dequantize(
            tensors[f"{name}.weight"], scale if scale.numel() > 1 else scale[0]
        )
        if activation == "none":
            continue
        input_scale = tensors.get(f"{name}.input_scale")

        def quantize(
            mod: Any, args: tuple[torch.Tensor, ...], input_scale: torch.Tensor | None = input_scale
        ) -> Any:
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            if input_scale is None:
                q, s = fp8.quantize_per_token(flat, FMT)
            else:
                s = input_scale.reshape(())
                q = fp8.quantize_static(flat, s, FMT)
            return (fp8.dequantize(q, s).reshape(x.shape),)

        module.register_forward_pre_hook(quantize)


CASES = [
    ("fp8", "tensor", "dynamic"),
    ("fp8", "tensor", "static"),
    ("compressed-tensors", "channel", "dynamic"),
    ("compressed-tensors", "tensor", "static"),
    ("compressed-tensors", "channel", "none"),
]


@pytest.mark.parametrize(("fmt", "strategy", "activation"), CASES, ids=["-".join(c) for c in CASES])
def test_fp8_checkpoint_loads_its_values_and_computes_its_scheme(
    fmt: str, strategy: str, activation: str, source: tuple[Path, Any], tmp_path: Path
) -> None:
    directory, _ = source
    ckpt = write_fp8_checkpoint(
        directory, tmp_path / "fp8", fmt,  # type: ignore[arg-type]
        weight_strategy=strategy, activation=activation, calibration=_prompts(4, seed=1),  # type: ignore[arg-type]
    )  # fmt: skip
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == fmt
    model = load_model(str(ckpt), "cpu", torch.float32).model
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, ParallelLinear)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        parts = [f.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"]
        part_scales = [f.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight_scale") for p in "qkv"]
    assert qkv.weight.dtype == FMT
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    rows = [p.shape[0] for p in parts]
    assert torch.equal(qkv.weight_scale, fp8.channel_scales(part_scales, rows))
    assert model.model.embed_tokens.weight.dtype == torch.float32  # not a linear layer
    assert model.lm_head_layer.weight.dtype == torch.float32

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    hf.config._attn_implementation = "sdpa"
    _hf_fp8_reference(hf, ckpt, activation)
    for prompt in _prompts(3, seed=2):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill_logits(model, prompt), want, rtol=1e-4, atol=1e-4)


def test_quantize_on_load_is_the_per_channel_dynamic_checkpoint(
    source: tuple[Path, Any], tmp_path: Path
) -> None:
    """Quantizing on load and loading a compressed-tensors checkpoint of the same scheme (one
    scale per channel, activations per token) give the same model, bit for bit."""
    directory, _ = source
    quantized = load_model(str(directory), "cpu", torch.float32, requested_quantization="fp8").model
    linears = [m for m in quantized.modules() if isinstance(m, ParallelLinear)]
    assert len(linears) == 3 * 4 and all(m.weight.dtype == FMT for m in linears)
    assert all(m.weight_scale.shape == (m.weight.shape[0],) for m in linears)
    ckpt = write_fp8_checkpoint(
        directory, tmp_path / "ct", "compressed-tensors", weight_strategy="channel", activation="dynamic"
    )
    stored = load_model(str(ckpt), "cpu", torch.float32).model
    exact = load_model(str(directory), "cpu", torch.float32).model
    for prompt in _prompts(3, seed=3):
        got = prefill_logits(quantized, prompt)
        assert torch.equal(got, prefill_logits(stored, prompt))
        want = prefill_logits(exact, prompt)
        # Random weights amplify rounding (SmolLM2's test measures a real model's agreement).
        assert float((got - want).norm() / want.norm()) < 0.25


def test_fp8_checkpoint_ignores_a_request_to_quantize_again(source: tuple[Path, Any], tmp_path: Path) -> None:
    directory, _ = source
    ckpt = write_fp8_checkpoint(directory, tmp_path / "fp8", "fp8", activation="dynamic")
    plain = load_model(str(ckpt), "cpu", torch.float32).model
    again = load_model(str(ckpt), "cpu", torch.float32, requested_quantization="fp8").model
    prompt = _prompts(1, seed=4)[0]
    assert torch.equal(prefill_logits(plain, prompt), prefill_logits(again, prompt))


def test_kv_cache_scales_come_from_the_checkpoint(source: tuple[Path, Any], tmp_path: Path) -> None:
    directory, _ = source
    ckpt = write_fp8_checkpoint(
        directory, tmp_path / "kv", "compressed-tensors", weight_strategy="channel",
        activation="dynamic", calibration=_prompts(4, seed=1), kv_cache_scales=True,
    )  # fmt: skip
    loaded = load_model(str(ckpt), "cpu", torch.float32)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        want = [
            [float(f.get_tensor(f"model.layers.{i}.self_attn.{kv}_scale")) for kv in "kv"] for i in range(3)
        ]
    assert loaded.kv_scales is not None and loaded.kv_scales.tolist() == want
    assert all(k > 0 and v > 0 and k != v for k, v in want)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"weight_block_size": [128, 128]}, "quantization_config.weight_block_size: block-wise FP8"),
        ({"quant_method": "gptq"}, "quantization_config.quant_method: 'gptq' is not supported"),
    ],
)
def test_unsupported_checkpoints_are_refused(
    patch: dict[str, Any], message: str, source: tuple[Path, Any], tmp_path: Path
) -> None:
    directory, _ = source
    ckpt = write_fp8_checkpoint(directory, tmp_path / "fp8", "fp8", activation="dynamic")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"].update(patch)
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedQuantizationError, match=message):
        load_model(str(ckpt), "cpu", torch.float32)
