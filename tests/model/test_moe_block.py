"""The MoE block's routing and reference experts against transformers' own blocks."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.config import ModelConfig, MoeConfig
from baton_engine.model.layers import BuildContext
from baton_engine.model.moe import SparseMoeBlock, route
from baton_engine.model.parallel import SINGLE, TensorParallel
from baton_engine.model.weight_source import TensorSource


def _block(
    family: str, config: MoeConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
) -> SparseMoeBlock:
    model = ModelConfig(
        family=family, vocab_size=16, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=True, moe=config,
    )  # fmt: skip
    ctx = BuildContext(model, dtype, "cpu", parallel)
    return SparseMoeBlock(ctx, "model.layers.0.mlp", config, implementation="torch")


def _load_stacked(block: SparseMoeBlock, hf: torch.nn.Module) -> None:
    """transformers 5's in-memory (stacked) tensors, through the block's checkpoint loader."""
    by_key = {key: name for name, key in block.checkpoint_names().items()}
    for key, tensor in (
        (("router", None), hf.gate.weight),
        (("gate_up", None), hf.experts.gate_up_proj),
        (("down", None), hf.experts.down_proj),
    ):
        block.load_checkpoint_tensor(key, TensorSource(tensor.data), by_key[key])


def _hf_block(family: str, norm_topk_prob: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, MoeConfig]:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_experts_per_tok=3, initializer_range=0.3)
    block: torch.nn.Module
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=24, num_local_experts=6, **common))
        mine = MoeConfig(6, 3, 24, norm_topk_prob=True, routing_in_float32=True, sparse_layers=(0,))
    else:
        hf = Qwen3MoeConfig(moe_intermediate_size=24, num_experts=6, norm_topk_prob=norm_topk_prob, **common)
        block = Qwen3MoeSparseMoeBlock(hf)
        mine = MoeConfig(6, 3, 24, norm_topk_prob, routing_in_float32=False, sparse_layers=(0,))
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block.to(dtype).eval(), mine


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers(family: str, norm_topk_prob: bool, dtype: torch.dtype) -> None:
    hf, config = _hf_block(family, norm_topk_prob, dtype)
    block = _block(family, config, dtype)
    _load_stacked(block, hf)
    assert block.missing_checkpoint_names({("router", None), ("gate_up", None), ("down", None)}) == []
    x = torch.randn(1, 19, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = hf(x)[0]
        got = block(x[0])
    # The same products, in the same order, rounded at the same points: identical values.
    assert torch.equal(got, want)


def test_routing_rules_per_family() -> None:
    logits_weight = torch.eye(4)  # the router logits are the hidden state itself
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(x, dim=-1)[0]
    qwen = MoeConfig(4, 2, 8, norm_topk_prob=False, routing_in_float32=False, sparse_layers=(0,))
    weights, ids = route(x, logits_weight, qwen)
    assert ids.tolist() == [[0, 1]]
    # softmax over all experts first, top-k after, no renormalisation
    torch.testing.assert_close(weights[0], probs[:2], rtol=0, atol=0)
    normed = MoeConfig(4, 2, 8, norm_topk_prob=True, routing_in_float32=False, sparse_layers=(0,))
    weights, _ = route(x, logits_weight, normed)
    torch.testing.assert_close(weights[0], probs[:2] / probs[:2].sum(), rtol=0, atol=0)
    mixtral = MoeConfig(4, 2, 8, norm_topk_prob=True, routing_in_float32=True, sparse_layers=(0,))
    weights, _ = route(x.bfloat16(), logits_weight.bfloat16(), mixtral)
    assert weights.dtype == torch.float32
    weights, _ = route(x.bfloat16(), logits_weight.bfloat16(), normed)
    assert weights.dtype == torch.bfloat16


def test_moe_config_refuses_more_experts_per_token_than_experts() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in \[1, num_experts \(4\)\]"):
        MoeConfig(4, 5, 8, norm_topk_prob=True, routing_in_float32=False, sparse_layers=(0,))


def test_tensor_parallel_ranks_hold_intermediate_shards_whose_outputs_sum_to_the_block() -> None:
    """Experts shard like the dense MLP: rank r holds rows [12r, 12r + 12) of each expert's gate
    and up and the same columns of its down; the ranks' partial outputs sum to the whole block
    (the all-reduce's sum, done here by hand: one process)."""
    hf, config = _hf_block("qwen3_moe", True, torch.float32)
    whole = _block("qwen3_moe", config, torch.float32)
    _load_stacked(whole, hf)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    parts = []
    for rank in (0, 1):
        # A group of two whose collectives are never called: forward's all-reduce is skipped by
        # running the reference experts directly on the rank's shard.
        block = _block("qwen3_moe", config, torch.float32, TensorParallel(rank, 2))
        _load_stacked(block, hf)
        gate, up = hf.experts.gate_up_proj.data[:, :24], hf.experts.gate_up_proj.data[:, 24:]
        rows = slice(12 * rank, 12 * rank + 12)
        assert torch.equal(block.experts.gate_up_proj, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(block.experts.down_proj, hf.experts.down_proj.data[:, :, rows])
        from baton_engine.model.moe import experts_reference

        weights, ids = route(x, block.gate.weight, config)
        parts.append(experts_reference(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids))
    with torch.no_grad():
        want = whole(x)
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-6)


def test_per_expert_checkpoint_names_and_what_is_missing() -> None:
    _, config = _hf_block("mixtral", True, torch.float32)
    block = _block("mixtral", config, torch.float32)
    names = block.checkpoint_names()
    assert names["model.layers.0.block_sparse_moe.gate.weight"] == ("router", None)
    assert names["model.layers.0.block_sparse_moe.experts.5.w1.weight"] == ("gate", 5)
    assert names["model.layers.0.block_sparse_moe.experts.5.w3.weight"] == ("up", 5)
    assert names["model.layers.0.block_sparse_moe.experts.5.w2.weight"] == ("down", 5)
    assert len(names) == 1 + 6 * 3 + 2
    loaded = {key for key in names.values() if key != ("down", 3)} - {("gate_up", None), ("down", None)}
    assert block.missing_checkpoint_names(loaded) == ["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(
        ValueError, match=r"experts\.2\.w1\.weight: checkpoint shape \(24, 31\), the model's \(24, 32\)"
    ):
        block.load_checkpoint_tensor(
            ("gate", 2),
            TensorSource(torch.zeros(24, 31)),
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
        )
