"""CPU linears through oneDNN with weights reordered once: same results as F.linear, same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from baton_engine.config import EngineConfig
from baton_engine.model.cpu_linear import pack_linears
from baton_engine.model.linear import ColumnParallelLinear, ParallelLinear
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY
from tests.model.driver import TestDriver

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(96, (160,), bias=bias, prefix="proj", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=generator))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(160, generator=generator))
    layer = layer.to(dtype)
    # Every row count a step can have: one decode row, a few, a prefill chunk.
    inputs = [torch.randn(rows, 96, generator=generator).to(dtype) for rows in (1, 5, 64, 300)]
    expected = [F.linear(x, layer.weight, layer.bias) for x in inputs]
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for x, want in zip(inputs, expected, strict=True):
        got = layer(x)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def _runner(tmp_path: Path, dtype: str) -> ModelRunner:
    spec = PARITY.replace(
        family="qwen2", llama3_rope=False, dtype="float32" if dtype != "float64" else "float64"
    )
    spec.save(tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model"), dtype=dtype, block_size=8, num_kv_blocks=64)  # type: ignore[arg-type]
    return ModelRunner(config)


def test_the_cpu_runner_packs_every_linear_and_the_head_once(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "float32")
    linears = [m for m in runner.model.modules() if isinstance(m, ParallelLinear)]
    assert len(linears) == 3 * 4  # qkv, o, gate_up, down per layer
    assert runner.model.lm_head is not None  # untied: its weight is packed once, for compute_logits
    assert runner.model.logits_packed is not None
    assert all(m.packed is not None for m in linears)
    assert pack_linears(runner.model) == 0  # already packed: nothing reordered twice


def test_float64_keeps_f_linear(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "float64")
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, ParallelLinear))
    assert runner.model.logits_packed is None
    assert pack_linears(runner.model) == 0


def test_packed_and_plain_linears_generate_the_same_tokens(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "float32")
    prompts = [[5, 17, 200, 33, 101, 250, 7, 64, 9, 11, 3], [40, 41, 42], [7] * 20]
    packed = [
        seq.outputs
        for seq in TestDriver(runner, max_num_batched_tokens=16, max_num_seqs=4).generate(
            prompts, [12, 12, 12]
        )
    ]
    for module in runner.model.modules():
        if isinstance(module, ParallelLinear):
            module.packed = None
    runner.model.logits_packed = None
    plain = [
        seq.outputs
        for seq in TestDriver(runner, max_num_batched_tokens=16, max_num_seqs=4).generate(
            prompts, [12, 12, 12]
        )
    ]
    assert packed == plain
    assert [len(tokens) for tokens in packed] == [12, 12, 12]
