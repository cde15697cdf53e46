"""Model shapes the benchmarks build with random weights (one definition each)."""

from __future__ import annotations

from baton_engine.model.config import ModelConfig, MoeConfig

LLAMA_32_1B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    name="llama-3.2-1b-shape",
)

QWEN3_30B_A3B = ModelConfig(
    family="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    qk_norm=True,
    moe=MoeConfig(
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        routing_in_float32=False,
        sparse_layers=tuple(range(48)),
    ),
    name="qwen3-30b-a3b-shape",
)
