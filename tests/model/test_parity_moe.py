"""Greedy parity with transformers `generate()` for tiny random Qwen3-MoE and Mixtral models
(float32, CPU), loaded from their safetensors folders and run through the runner with chunked
prefill, prefix hits and mixed decode/prefill steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.model.moe import CHECKPOINT_NAMES, SparseMoeBlock
from baton_engine.model.quantization.fp8_config import UnsupportedQuantizationError
from baton_engine.worker.model_runner import ModelRunner
from baton_support.fp8_checkpoints import write_fp8_checkpoint
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


def _dequantized_copy(checkpoint: Path, target: Path) -> Path:
    """The 16-bit (float32) model an FP8 checkpoint describes: each FP8 weight times its scale."""
    import shutil

    from safetensors.torch import load_file, save_file

    from baton_engine.model.quantization import fp8

    tensors = load_file(str(checkpoint / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        plain[name] = tensor if scale is None else fp8.dequantize(tensor, scale.reshape(-1).squeeze(0))
    target.mkdir()
    save_file(plain, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    for extra in checkpoint.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copy(extra, target / extra.name)
    return target


FP8_CASES = [
    ("qwen3_moe", "fp8", "tensor", "dynamic"),
    ("qwen3_moe", "compressed-tensors", "channel", "none"),
    ("mixtral", "compressed-tensors", "tensor", "none"),
]


@pytest.mark.parametrize(
    ("family", "fmt", "strategy", "activation"), FP8_CASES, ids=["-".join(c) for c in FP8_CASES]
)
def test_fp8_checkpoint_experts_load_exactly_and_match_transformers_on_the_dequantized_model(
    family: str, fmt: str, strategy: str, activation: str, tmp_path: Path
) -> None:
    """An FP8 MoE checkpoint (written by `write_fp8_checkpoint`, every expert projection FP8 with
    its own scale) loads each expert's stored bits and scales as they are; the experts multiply
    weight-only, so with weight-only dense layers the greedy tokens are transformers' on the
    dequantized weights, token for token."""
    from safetensors.torch import load_file

    from baton_engine.model.loader.model_loading import load_model
    from baton_engine.model.quantization import fp8

    _spec(family).save(tmp_path / "source")
    ckpt = write_fp8_checkpoint(
        tmp_path / "source", tmp_path / "fp8", fmt, weight_strategy=strategy, activation=activation,  # type: ignore[arg-type]
    )  # fmt: skip
    stored = load_file(str(ckpt / "model.safetensors"))
    names = CHECKPOINT_NAMES[family]
    model = load_model(str(ckpt), "cpu", torch.float32).model
    for layer in (0, 2):
        block = model.model.layers[layer].mlp
        assert isinstance(block, SparseMoeBlock)
        experts = block.experts
        assert (
            experts.gate_up_proj.dtype == torch.float8_e4m3fn
            and experts.down_proj.dtype == torch.float8_e4m3fn
        )
        assert block.gate.weight.dtype == torch.float32  # the router stays 16/32-bit
        for expert in (0, experts.gate_up_proj.shape[0] - 1):
            gate, up, down = (f"model.layers.{layer}.{n.format(e=expert)}" for n in names[:3])
            inter, hidden = stored[f"{gate}.weight"].shape
            want_bits = torch.cat([stored[f"{gate}.weight"], stored[f"{up}.weight"]]).view(torch.uint8)
            assert torch.equal(experts.gate_up_proj[expert].view(torch.uint8), want_bits)
            assert torch.equal(
                experts.down_proj[expert].view(torch.uint8), stored[f"{down}.weight"].view(torch.uint8)
            )
            want_scales = fp8.channel_scales(
                [stored[f"{gate}.weight_scale"], stored[f"{up}.weight_scale"]], [inter, inter]
            )
            assert torch.equal(experts.gate_up_scale[expert], want_scales)
            assert torch.equal(
                experts.down_scale[expert], fp8.channel_scales([stored[f"{down}.weight_scale"]], [hidden])
            )
    if strategy == "tensor":  # one scale per expert projection, repeated over its rows
        halves = (experts.gate_up_scale[0, :inter], experts.gate_up_scale[0, inter:])
        assert [half.unique().numel() for half in halves] == [1, 1]
    if activation != "none":
        return  # dense layers quantize their prefill activations: not transformers' arithmetic
    reference = _dequantized_copy(ckpt, tmp_path / "dequantized")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    hf.config._attn_implementation = "sdpa"
    prompts, new_tokens = _prompts()
    prompts, new_tokens = prompts[:5], new_tokens[:5]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    runner = ModelRunner(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=200))
    got = [
        seq.outputs
        for seq in TestDriver(runner, max_num_batched_tokens=20, max_num_seqs=5).generate(prompts, new_tokens)
    ]
    assert got == expected


def _refusal_case(case: str, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    _spec("qwen3_moe").save(tmp_path / "source")
    ckpt = write_fp8_checkpoint(
        tmp_path / "source",
        tmp_path / "fp8",
        "compressed-tensors",
        weight_strategy="channel",
        activation="none",
    )
    weights = load_file(str(ckpt / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    if case == "16-bit expert":
        weights["model.layers.2.mlp.experts.3.up_proj.weight"] = weights[
            "model.layers.2.mlp.experts.3.up_proj.weight"
        ].float()
    elif case == "no scale":
        del weights["model.layers.2.mlp.experts.3.down_proj.weight_scale"]
    elif case == "scale shape":  # half the output channels' scales
        scale = weights["model.layers.2.mlp.experts.3.down_proj.weight_scale"]
        weights["model.layers.2.mlp.experts.3.down_proj.weight_scale"] = scale[: scale.shape[0] // 2].clone()
    elif case == "mixed experts":
        config["quantization_config"]["ignore"].append("re:.*experts\\.7\\.down_proj$")
    elif case == "fp8 router":
        weights["model.layers.0.mlp.gate.weight"] = weights["model.layers.0.mlp.gate.weight"].to(
            torch.float8_e4m3fn
        )
    elif case == "block-wise":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


REFUSALS = [
    (
        "16-bit expert",
        UnsupportedQuantizationError,
        r"^model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight: a torch\.float32 tensor where the "
        r"quantization_config makes the experts FP8 \(float8_e4m3fn\)$",
    ),
    (
        "no scale",
        ValueError,
        r"^checkpoint lacks 1 weights the model needs, e\.g\. "
        r"\['model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight_scale'\]$",
    ),
    (
        "scale shape",
        ValueError,
        r"^model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight_scale: shape \(32, 1\), expected a "
        r"per-tensor scale \(\[\] or \[1\]\) or one per output channel \(\[64, 1\]\)$",
    ),
    (
        "mixed experts",
        UnsupportedQuantizationError,
        r"^quantization_config: some expert projections are FP8 "
        r"\(model\.layers\.0\.mlp\.experts\.0\.down_proj\) and some 16-bit "
        r"\(model\.layers\.0\.mlp\.experts\.7\.down_proj\)",
    ),
    (
        "fp8 router",
        UnsupportedQuantizationError,
        r"^model\.layers\.0\.mlp\.gate\.weight: an FP8 tensor \(torch\.float8_e4m3fn\) where the model "
        r"expects 16 bits",
    ),
    (
        "block-wise",
        UnsupportedQuantizationError,
        r"^quantization_config\.weight_block_size: block-wise FP8 scales are not supported",
    ),
]


@pytest.mark.parametrize(("case", "error", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_fp8_moe_checkpoints_the_engine_cannot_run_exactly_are_refused_naming_the_tensor_or_key(
    case: str, error: type[Exception], message: str, tmp_path: Path
) -> None:
    from baton_engine.model.loader.model_loading import load_model

    ckpt = _refusal_case(case, tmp_path)
    with pytest.raises(error, match=message):
        load_model(str(ckpt), "cpu", torch.float32)
