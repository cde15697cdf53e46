"""Every position's logits of one prompt through a `CausalLM` (torch attention, a scratch KV
cache of its own): what tests and benchmarks compare models by, outside any runner."""

from __future__ import annotations

import numpy as np
import torch

from baton_engine.model.attention.backend import get_attention_backend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.llama import CausalLM


def prefill_logits(model: CausalLM, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(prompt), vocab] of every position of one prompt, prefilled in one step by the
    torch attention backend (a scratch KV cache of its own)."""
    n = len(prompt)
    blocks = np.arange(1, 1 + -(-n // block_size))
    config = model.config
    device = model.model.norm.weight.device
    cache = torch.zeros(
        config.num_layers, 2, len(blocks) + 1, block_size, model.num_local_kv_heads, config.head_dim,
        dtype=model.model.norm.weight.dtype, device=device,
    )  # fmt: skip
    slots = blocks[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
    batch = AttentionBatch(
        block_size=block_size,
        num_decode_rows=0,
        query_start_loc=np.array([0, n]),
        seq_lens=np.array([n]),
        num_computed_tokens=np.array([0]),
        positions_host=np.arange(n),
        block_tables_host=blocks[None, :],
        slot_mapping=torch.from_numpy(slots).to(device),
        positions=torch.arange(n, device=device),
    )
    with torch.no_grad():
        hidden = model(
            torch.tensor(prompt, device=device), cache, get_attention_backend("torch", device), batch
        )
        return model.compute_logits(hidden)
