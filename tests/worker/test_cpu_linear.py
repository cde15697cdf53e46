"""CPU linears through oneDNN with weights reordered once: same results as F.linear, same tokens,
and a bounded number of oneDNN primitives however many row counts the steps have."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from baton_engine.config import EngineConfig
from baton_engine.model import cpu_linear
from baton_engine.model.cpu_linear import onednn_bf16_supported, pack_linears
from baton_engine.model.layers import GatedMLP
from baton_engine.model.linear import ColumnParallelLinear, ParallelLinear, onednn_rows
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY
from tests.model.driver import TestDriver

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


ONEDNN_BF16 = pytest.mark.skipif(
    not onednn_bf16_supported(), reason="this CPU has no oneDNN bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=ONEDNN_BF16)])
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


def _runner(tmp_path: Path, dtype: str, hidden_size: int = PARITY.hidden_size) -> ModelRunner:
    spec = PARITY.replace(
        family="qwen2",
        llama3_rope=False,
        dtype="float32" if dtype != "float64" else "float64",
        hidden_size=hidden_size,
    )
    spec.save(tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model"), dtype=dtype, block_size=8, num_kv_blocks=64)  # type: ignore[arg-type]
    return ModelRunner(config)


def test_the_cpu_runner_packs_every_linear_and_the_head_once(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "float32")
    layers = runner.model.model.decoder_layers()
    assert len(layers) == 3
    assert runner.model.lm_head is not None  # untied: its weight is packed once, for compute_logits
    assert runner.model.logits_packed is not None
    for layer in layers:
        assert layer.self_attn.qkv_proj.packed is not None and layer.self_attn.o_proj.packed is not None
        mlp = layer.mlp
        assert isinstance(mlp, GatedMLP)
        # gate and up apart (each product contiguous for silu and the multiply in place), the merged
        # one not at all
        assert mlp.gate_packed is not None and mlp.up_packed is not None
        assert mlp.gate_up_proj.packed is None and mlp.down_proj.packed is not None
        assert layer.self_attn.rotate_in_place
    assert pack_linears(runner.model) == 0  # already packed: nothing reordered twice


def test_the_packed_mlp_matches_the_unpacked_passes() -> None:
    generator = torch.Generator().manual_seed(11)
    mlp = GatedMLP(64, 96, bias=True, prefix="mlp", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    model = torch.nn.Module()
    model.mlp = mlp
    for rows in (1, 9, 300):  # 9 and 300 run padded to a row bucket
        x = torch.randn(rows, 64, generator=generator)
        residual = torch.randn(rows, 64, generator=generator)
        gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
        want = residual + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        assert torch.equal(mlp(x, residual=residual), want)  # nothing packed: the separate passes
        mlp.gate_packed = torch.ops.mkldnn._reorder_linear_weight(mlp.gate_up_proj.weight[:96].contiguous())
        mlp.up_packed = torch.ops.mkldnn._reorder_linear_weight(mlp.gate_up_proj.weight[96:].contiguous())
        mlp.down_proj.packed = torch.ops.mkldnn._reorder_linear_weight(mlp.down_proj.weight.detach())
        with torch.inference_mode():
            got = mlp(x, residual=residual)
        assert got.shape == (rows, 64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        mlp.gate_packed = mlp.up_packed = mlp.down_proj.packed = None


def test_float64_keeps_f_linear(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "float64")
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, ParallelLinear))
    assert runner.model.logits_packed is None
    assert pack_linears(runner.model) == 0


def test_bfloat16_on_a_cpu_without_onednn_bfloat16_keeps_f_linear_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN refuses to reorder a bfloat16 weight on an AVX2-only CPU: the runner must not try.
    monkeypatch.setattr(cpu_linear, "onednn_bf16_supported", lambda: False)
    runner = _runner(tmp_path, "bfloat16")
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, ParallelLinear))
    assert runner.model.logits_packed is None
    outputs = TestDriver(runner, max_num_batched_tokens=16, max_num_seqs=2).generate(
        [[5, 17, 200], [40, 41]], [6, 6]
    )
    assert [len(seq.outputs) for seq in outputs] == [6, 6]


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
        if isinstance(module, GatedMLP):
            module.gate_packed = module.up_packed = None
    runner.model.logits_packed = None
    plain = [
        seq.outputs
        for seq in TestDriver(runner, max_num_batched_tokens=16, max_num_seqs=4).generate(
            prompts, [12, 12, 12]
        )
    ]
    assert packed == plain
    assert [len(tokens) for tokens in packed] == [12, 12, 12]


_CREATED = re.compile(
    r",create:cache_miss,cpu,inner_product,.* bia:(\w+):.*attr-scratchpad:user(?: attr-post-ops:(\S+))?,,"
    r"mb(\d+)ic(\d+)oc(\d+),"
)


@contextmanager
def _onednn_log(capfd: pytest.CaptureFixture[str]) -> Iterator[list[tuple[int, int, int, str]]]:
    """The (rows, in, out, biased, post-ops) of every inner-product primitive oneDNN creates
    meanwhile (a cache miss: its verbose log, written by the library to file descriptor 1)."""
    created: list[tuple[int, int, int, bool, str]] = []
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):  # type: ignore[no-untyped-call]
        yield created
    out = capfd.readouterr().out
    created.extend(
        (int(m), int(i), int(o), bias != "undef", post) for bias, post, m, i, o in _CREATED.findall(out)
    )


def test_row_buckets() -> None:
    rows = (1, 2, 7, 8, 9, 10, 11, 15, 16, 17, 20, 21, 33, 100, 1000, 2048)
    assert [onednn_rows(n) for n in rows] == [1, 2, 7, 8, 10, 10, 12, 16, 16, 20, 20, 24, 40, 112, 1024, 2048]
    buckets = {onednn_rows(rows) for rows in range(1, 2049)}
    assert len(buckets) == 40
    assert all(rows <= onednn_rows(rows) <= rows * 1.25 for rows in range(1, 4097))


def test_each_row_bucket_builds_one_primitive(capfd: pytest.CaptureFixture[str]) -> None:
    # oneDNN caches a primitive (0.2-1.8 MiB) per input shape: one per row count made an engine
    # core grow by hundreds of MiB as its steps' sizes varied.
    layer = ColumnParallelLinear(96, (176,), bias=True, prefix="proj", dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the layer's parameters start uninitialised: NaNs would make equal() fail
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    with torch.inference_mode(), _onednn_log(capfd) as created:
        outputs = {rows: layer(torch.ones(rows, 96)) for rows in range(1, 301)}
        again = layer(torch.ones(37, 96))
    assert sorted(created) == sorted(
        (rows, 96, 176, True, "") for rows in {onednn_rows(r) for r in range(1, 301)}
    )
    assert all(out.shape == (rows, 176) for rows, out in outputs.items())
    assert torch.equal(again, outputs[37])


def test_an_engine_step_of_any_size_reuses_the_bucket_primitives(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Its own width: oneDNN's cache is the process's, and no other test builds these shapes.
    runner = _runner(tmp_path, "float32", hidden_size=80)
    generator = torch.Generator().manual_seed(5)
    lengths = range(1, 49)
    with _onednn_log(capfd) as created:
        for length in lengths:  # one prompt per step: the step has `length` rows
            prompt = torch.randint(0, 256, (length,), generator=generator).tolist()
            TestDriver(runner, max_num_batched_tokens=64, max_num_seqs=1).generate([prompt], [1])
    buckets = {onednn_rows(length) for length in lengths}
    # the post-op's name: oneDNN marks a one-row operand as broadcast (its own primitive, named so)
    kinds = {(i, o, biased, post.split(":")[0]) for _, i, o, biased, post in created}
    config = runner.model_config
    assert len(buckets) == 18
    assert {(i, post) for i, _, _, post in kinds} == {
        (80, ""),  # qkv, gate and up (one shape, one primitive), the LM head
        (config.num_heads * config.head_dim, "binary_add"),  # o + the residual
        (config.intermediate_size, "binary_add"),  # down + the residual
    }
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    assert {(i, o, biased) for i, o, biased, post in kinds if not post} == {
        (80, qkv_width, True),  # Qwen2's qkv bias
        (80, config.intermediate_size, False),  # gate and up: one primitive
        (80, config.vocab_size, False),
    }
    assert {
        rows for rows, i, _, _, _ in created if i == 80
    } == buckets  # a step of N rows ran as onednn_rows(N)
    assert len(created) == len(set(created))  # each (rows, shape, bias, post-ops) built once
