"""Grammar token bitmasks applied to logits before sampling.

A bitmask row has one int32 word per 32 tokens; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed (llguidance's layout, `baton_engine.structured.matcher.Bitmask`). The
scheduler computes the rows of a step's constrained sampled positions
(`SchedulerOutput.grammar_bitmask`); the runner sets every refused token's logit to -inf in
place, so the sampler (greedy, temperature, top-k/p) can only pick an allowed token.

Two implementations of the same operation:

- `apply_token_bitmask`: tensor ops only (shift, and, masked_fill), for a device: nothing is
  read back, so applying a mask never syncs the host with the device.
- `apply_token_bitmask_host`: for logits on the CPU, where the device is the host: numpy
  unpacks the bits (one cheap pass over the bitmask) and torch does one masked_fill over the
  logits. Several times faster on a CPU than the tensor-op version (`bench.grammar_mask`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

_BIT_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BIT_POSITIONS.get(device)
    if bits is None:
        bits = _BIT_POSITIONS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def bitmask_to_refused(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True = refused (tensor ops)."""
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] == 0


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set the logits of refused tokens to -inf in place, with tensor ops on `logits`' device.

    `bitmask` ([G, words] int32, on that device) has one row per logits row, or per entry of
    `rows` (int64 indices of the constrained logits rows) when given."""
    refused = bitmask_to_refused(bitmask, logits.shape[-1])
    if rows is None:
        logits.masked_fill_(refused, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(refused, float("-inf"))


def apply_token_bitmask_host(
    logits: torch.Tensor, bitmask: npt.NDArray[np.int32], rows: npt.NDArray[np.int64] | None = None
) -> None:
    """`apply_token_bitmask` for CPU logits and a numpy bitmask."""
    vocab_size = logits.shape[-1]
    # Inverting the words first makes the unpacked bits the refused set directly.
    inverted = np.ascontiguousarray(~bitmask)
    refused = np.unpackbits(inverted.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    refused_tensor = torch.from_numpy(refused.view(np.bool_))
    if rows is None:
        logits.masked_fill_(refused_tensor, float("-inf"))
    else:
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        logits[index] = logits[index].masked_fill(refused_tensor, float("-inf"))
