"""Model shapes the benchmarks build with random weights (one definition each)."""

from __future__ import annotations

from baton_engine.model.config import ModelConfig

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
