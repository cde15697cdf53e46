"""Token bitmasks applied to logits on the device: one int32 word per 32 tokens, bit set =
allowed (llguidance's layout). Pure tensor ops, so applying a mask never syncs the host."""

from __future__ import annotations

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set the logits of disallowed tokens to -inf in place. `bitmask` has one row per logits
    row, or per entry of `rows` (indices of the constrained logits rows) when given."""
    allowed = bitmask_to_allowed(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device, non_blocking=True)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
