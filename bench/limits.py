"""Physical limits of decoder work: the time its bytes take at a copy bandwidth and its FLOPs at a
matrix rate, both measured in the same run (`bench.gpu`). Pure arithmetic, no torch.

A decoder step over B rows at contexts c_i reads every weight once and each row's K/V once:
``bytes = weight_bytes + sum(c_i) * kv_bytes_per_token``; it multiplies each token by every weight
(2 FLOPs per weight element) and each token's query by its context's keys and values
(``attention_flops_per_context_token`` per cached position). Its limit is the larger of the two
times (no overlap could beat either). A whole run's limit sums its steps' limits: a prefill step
per request batch, then one decode step per generated token after the first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    """What the device measured: bytes per second of a device-to-device copy (read + written)
    and FLOPs per second of a large bf16 matrix product."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass(frozen=True)
class DecoderCost:
    """Per-token costs of one model shape in one dtype."""

    #: Bytes of every weight a step reads (the embedding table only as the LM head, if tied).
    weight_bytes: int
    #: FLOPs of the matrix products per token (2 per weight element read).
    flops_per_token: float
    #: K/V bytes of one cached position over all layers.
    kv_bytes_per_token: int
    #: Attention FLOPs per query token per cached position (QK^T and PV over all layers).
    attention_flops_per_context_token: float

    @staticmethod
    def of(
        weight_bytes: int,
        element_bytes: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> DecoderCost:
        return DecoderCost(
            weight_bytes=weight_bytes,
            flops_per_token=2.0 * weight_bytes / element_bytes,
            kv_bytes_per_token=2 * num_layers * num_kv_heads * head_dim * element_bytes,
            attention_flops_per_context_token=4.0 * num_layers * num_heads * head_dim,
        )


def step_limit_s(cost: DecoderCost, ceilings: Ceilings, contexts: list[int], query_tokens: int = 1) -> float:
    """The limit of one step: `query_tokens` new tokens for each row, row i attending to
    ``contexts[i]`` positions (its new tokens included)."""
    tokens = query_tokens * len(contexts)
    bytes_read = cost.weight_bytes + sum(contexts) * cost.kv_bytes_per_token
    flops = tokens * cost.flops_per_token
    flops += query_tokens * sum(contexts) * cost.attention_flops_per_context_token
    return max(bytes_read / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops_per_s)


def prefill_limit_s(cost: DecoderCost, ceilings: Ceilings, prompt_lens: list[int]) -> float:
    """All prompts' prefill (causal: a prompt of n tokens attends to n (n + 1) / 2 positions)."""
    tokens = sum(prompt_lens)
    flops = tokens * cost.flops_per_token
    flops += sum(n * (n + 1) / 2 for n in prompt_lens) * cost.attention_flops_per_context_token
    bytes_moved = cost.weight_bytes + tokens * cost.kv_bytes_per_token  # K/V written once
    return max(bytes_moved / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops_per_s)


def run_limit_s(
    cost: DecoderCost, ceilings: Ceilings, prompt_lens: list[int], output_lens: list[int]
) -> float:
    """Prefill of every prompt, then decode steps until the longest output is done: step s
    (s = 1, 2, ...) decodes the requests with more than s output tokens (the first comes from
    prefill), each at context ``prompt + s``."""
    total = prefill_limit_s(cost, ceilings, prompt_lens)
    for s in range(1, max(output_lens)):
        contexts = [p + s for p, n in zip(prompt_lens, output_lens, strict=True) if n > s]
        total += step_limit_s(cost, ceilings, contexts)
    return total
