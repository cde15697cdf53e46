"""The MoE block's routing and reference experts against transformers' own blocks."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.config import MoeConfig
from baton_engine.model.moe import SparseMoeBlock, route


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
    block = SparseMoeBlock(32, config, implementation="torch")
    block.load_state_dict(
        {
            "gate.weight": hf.gate.weight,
            "experts.gate_up_proj": hf.experts.gate_up_proj,
            "experts.down_proj": hf.experts.down_proj,
        },
        assign=True,
    )
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
