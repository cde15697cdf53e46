"""The MoE GPU benchmark's model builders, checked on the CPU with a tiny Qwen3-MoE shape: the
engine and transformers hold the same random weights (transformers' are views of the engine's)
and give the same logits."""

from __future__ import annotations

import dataclasses

import torch

from baton_engine.model.attention.backend import get_attention_backend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.config import MoeConfig
from baton_engine.model.llama import build_model
from bench.gpu_moe import hf_qwen3_moe, hf_state_from_engine, moe_random_weights
from bench.shapes import QWEN3_30B_A3B

TINY = dataclasses.replace(
    QWEN3_30B_A3B,
    vocab_size=100,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    moe=MoeConfig(8, 2, 16, norm_topk_prob=True, routing_in_float32=False, sparse_layers=(0, 1)),
    max_position_embeddings=64,
)


def test_engine_and_transformers_share_the_weights_and_agree() -> None:
    weights = moe_random_weights(TINY, torch.float32, seed=1, device="cpu")
    model = build_model(TINY, weights, torch.float32, "cpu")
    hf = hf_qwen3_moe(TINY, hf_state_from_engine(model), device="cpu")
    experts = model.model.layers[1].mlp.experts.gate_up_proj
    assert experts.data_ptr() == hf.model.layers[1].mlp.experts.gate_up_proj.data_ptr()
    v_rows = TINY.num_kv_heads * TINY.head_dim
    assert hf.model.layers[0].self_attn.v_proj.weight.data_ptr() == (
        model.model.layers[0].self_attn.qkv_proj.weight[-v_rows:].data_ptr()
    )
    prompt = list(range(3, 20))
    n = len(prompt)
    cache = torch.zeros(TINY.num_layers, 2, 4, 8, TINY.num_kv_heads, TINY.head_dim)
    batch = AttentionBatch(
        block_size=8,
        num_decode_rows=0,
        query_start_loc=torch.tensor([0, n]).numpy(),
        seq_lens=torch.tensor([n]).numpy(),
        num_computed_tokens=torch.tensor([0]).numpy(),
        positions_host=torch.arange(n).numpy(),
        block_tables_host=torch.tensor([[0, 1, 2]]).numpy(),
        slot_mapping=torch.arange(n),
        positions=torch.arange(n),
    )
    with torch.no_grad():
        hidden = model(
            torch.tensor(prompt), cache, get_attention_backend("torch", torch.device("cpu")), batch
        )
        got = model.compute_logits(hidden)
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
