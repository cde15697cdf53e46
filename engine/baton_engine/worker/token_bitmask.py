"""Grammar token bitmasks applied to logits before sampling.

A bitmask row has one int32 word per 32 tokens; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed (llguidance's layout, `baton_engine.structured.matcher.Bitmask`). The
scheduler computes the rows of a step's constrained sampled positions
(`SchedulerOutput.grammar_bitmask`); the runner sets every refused token's logit to -inf in
place, so the sampler (greedy, temperature, top-k/p) can only pick an allowed token.

Two implementations of the same operation:

- `apply_token_bitmask`: tensor ops only (shift, and, masked_fill), for a device: nothing is
  read back, so applying a mask never syncs the host with the device.
- `apply_token_bitmask_host`: for logits on the CPU, where the device is the host. A CPU's
  masked_fill with an irregular mask mispredicts a branch per element (~40 ns each: 120 ms for
  [64, 49152] logits); instead each bitmask byte looks its 8 tokens' biases (0 or -inf) up in a
  256-entry table (`np.take`, a copy of 32 bytes per byte) and one vectorised add applies them:
  about 1 ms (`bench.grammar_mask`).
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


def _byte_biases() -> npt.NDArray[np.float32]:
    """[256, 8]: for each bitmask byte, its 8 tokens' logit biases (bit set: 0, clear: -inf)."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


_BYTE_BIASES = _byte_biases()


def apply_token_bitmask_host(
    logits: torch.Tensor, bitmask: npt.NDArray[np.int32], rows: npt.NDArray[np.int64] | None = None
) -> None:
    """`apply_token_bitmask` for CPU logits and a numpy bitmask (little-endian words, as on
    every CPU torch runs on: byte ``b`` of word ``w`` holds tokens ``32w + 8b ..``)."""
    vocab_size = logits.shape[-1]
    as_bytes = np.ascontiguousarray(bitmask).view(np.uint8)
    bias = np.take(_BYTE_BIASES, as_bytes, axis=0).reshape(len(bitmask), -1)[:, :vocab_size]
    bias_tensor = torch.from_numpy(bias)
    if rows is None:
        logits.add_(bias_tensor)
    else:
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        logits[index] = logits[index] + bias_tensor
