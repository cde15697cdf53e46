"""Greedy parity with transformers `generate()` for tiny random Qwen3-MoE and Mixtral models
(float32, CPU), loaded from their safetensors folders and run through the runner with chunked
prefill, prefix hits and mixed decode/prefill steps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.model.moe import SparseMoeBlock
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY, TinyModel, hf_greedy
from tests.model.driver import TestDriver

VOCAB = PARITY.vocab_size


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(77)
    shared = [rng.randrange(VOCAB) for _ in range(19)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 3, 7, 12, 26, 41)]
    prompts += [shared + [rng.randrange(VOCAB) for _ in range(tail)] for tail in (2, 9, 15)]
    prompts.append(list(prompts[4]))  # an exact duplicate
    return prompts, [3 + (i * 7) % 11 for i in range(len(prompts))]


def _spec(family: str, norm_topk_prob: bool = True) -> TinyModel:
    return PARITY.replace(
        family=family, llama3_rope=False, dtype="float32", seed=11, norm_topk_prob=norm_topk_prob
    )


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]
)
def test_greedy_tokens_match_transformers_float32(family: str, norm_topk_prob: bool, tmp_path: Path) -> None:
    reference = _spec(family, norm_topk_prob).save(tmp_path)
    reference.config._attn_implementation = "sdpa"
    prompts, new_tokens = _prompts()
    expected = [hf_greedy(reference, p, n) for p, n in zip(prompts, new_tokens, strict=True)]

    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=300))
    layers = runner.model.model.layers
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == ([0, 2] if family == "qwen3_moe" else [0, 1, 2])  # qwen3_moe: layer 1 dense
    driver = TestDriver(runner, max_num_batched_tokens=20, max_num_seqs=5)
    got = [seq.outputs for seq in driver.generate(prompts, new_tokens)]

    assert driver.stats.prefix_hit_tokens > 0
    assert driver.stats.chunked_prefill_rows > 0
    assert driver.stats.mixed_steps > 0
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert mismatches == [], [(i, got[i], expected[i]) for i in mismatches]


def test_moe_config_from_checkpoint(tmp_path: Path) -> None:
    _spec("qwen3_moe").save(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=4))
    moe = runner.model_config.moe
    assert moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 64)
    assert (moe.norm_topk_prob, moe.routing_in_float32, moe.sparse_layers) == (True, False, (0, 2))
    experts = runner.model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 128, 64)
    assert tuple(experts.down_proj.shape) == (8, 64, 64)
    assert runner.model_config.qk_norm is True
    assert runner.kv_cache.dtype == torch.float32


def test_checkpoint_missing_an_expert_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _spec("mixtral").save(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"checkpoint lacks 1 weights the model needs, e\.g\. "
        r"\['model\.layers\.2\.block_sparse_moe\.experts\.3\.w2\.weight'\]$",
    ):
        ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=4))


def test_quantize_on_load_stores_each_experts_fp8_weights_with_per_channel_scales(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from baton_engine.model.loader.model_loading import load_model
    from baton_engine.model.quantization import fp8

    _spec("qwen3_moe").save(tmp_path)
    loaded = load_model(str(tmp_path), "cpu", torch.float32, requested_quantization="fp8")
    experts = loaded.model.model.layers[2].mlp.experts
    assert (
        experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj.dtype == torch.float8_e4m3fn
    )
    assert experts.gate_up_scale is not None and experts.down_scale is not None
    assert (tuple(experts.gate_up_scale.shape), tuple(experts.down_scale.shape)) == ((8, 128), (8, 64))
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    up = checkpoint["model.layers.2.mlp.experts.5.up_proj.weight"]
    q, scale = fp8.quantize_weight(up, torch.float8_e4m3fn)
    assert torch.equal(experts.gate_up_proj[5, 64:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(experts.gate_up_scale[5, 64:], scale)
    gate_up, _ = experts.dequantized(torch.float32)
    assert torch.equal(gate_up[5, 64:], fp8.dequantize(q, scale))
    dense = loaded.model.model.layers[1].mlp  # qwen3_moe's mlp_only layer: an FP8 linear method
    assert dense.gate_up_proj.weight.dtype == torch.float8_e4m3fn


def test_fp8_checkpoints_of_moe_models_are_refused_naming_the_layer() -> None:
    from baton_engine.model.llama import CausalLM
    from baton_engine.model.loader.hf_config import model_config_from_hf
    from baton_engine.model.quantization.fp8_config import (
        UnsupportedQuantizationError,
        parse_quantization_config,
    )
    from baton_engine.model.quantization.fp8_linear import Fp8Quantization

    raw = {**_spec("mixtral").hf_config().to_dict(), "architectures": ["MixtralForCausalLM"]}
    config = model_config_from_hf(raw, "tiny-mixtral")
    checkpoint = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"^model\.layers\.0\.mlp: FP8 checkpoints of mixture-of-experts models are not supported yet",
    ):
        CausalLM(config, torch.float32, "cpu", quantization=Fp8Quantization(checkpoint, torch.float8_e4m3fn))
