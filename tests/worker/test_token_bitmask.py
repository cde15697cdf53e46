"""Grammar bitmasks applied to logits: the device version (tensor ops) and the CPU version
(numpy unpacking) refuse exactly the tokens whose bit is clear, on the rows named, and agree
with each other on random masks."""

from __future__ import annotations

import numpy as np
import torch

from baton_engine.worker.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_host,
    bitmask_to_refused,
)


def test_bits_map_to_tokens() -> None:
    bitmask = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)  # bit 31 of word 1: token 63
    refused = bitmask_to_refused(bitmask, 40)
    assert (~refused[0]).nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert (~refused[1]).nonzero().flatten().tolist() == []  # bit 63 is past the vocabulary


def test_both_versions_mask_only_the_rows_named() -> None:
    bitmask = np.array([[0b101, -1], [0, -(1 << 31)]], dtype=np.int32)
    for apply in ("device", "host"):
        logits = torch.zeros(3, 40)
        if apply == "device":
            apply_token_bitmask(logits, torch.from_numpy(bitmask), rows=torch.tensor([2, 0]))
        else:
            apply_token_bitmask_host(logits, bitmask, rows=np.array([2, 0]))
        assert torch.isinf(logits[1]).sum() == 0, apply  # row 1 is unconstrained
        assert (~torch.isinf(logits[2])).nonzero().flatten().tolist() == [0, 2, *range(32, 40)], apply
        assert torch.isinf(logits[0]).all(), apply
        assert (logits[~torch.isinf(logits)] == 0).all()  # allowed logits keep their value


def test_the_versions_agree_on_random_masks() -> None:
    generator = np.random.default_rng(7)
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = generator.integers(-(2**31), 2**31, size=(6, (vocab + 31) // 32), dtype=np.int64).astype(
        np.int32
    )
    logits = torch.from_numpy(generator.standard_normal((6, vocab)).astype(np.float32))
    on_device, on_host = logits.clone(), logits.clone()
    apply_token_bitmask(on_device, torch.from_numpy(bitmask))
    apply_token_bitmask_host(on_host, bitmask)
    assert torch.equal(on_device, on_host)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)
    assert torch.equal(torch.isinf(on_host), torch.from_numpy(~bits))
    assert torch.equal(on_host[torch.from_numpy(bits)], logits[torch.from_numpy(bits)])
