"""Token sampling: greedy, temperature, top-k, top-p, top-n logprobs, position-keyed seeds.

Random rows are sampled by inverting the CDF of the filtered distribution with ONE uniform
number per sampled position. That number is a counter-based hash of a 64-bit key, and a seeded
request's key is derived from (seed, output position) only — so its tokens do not depend on the
batch it ran in, on preemption, or on which engine (prefill or decode pod) sampled it. The hash
is integer tensor arithmetic, identical on CPU and GPU and free of per-row host syncs.
Unseeded rows get a fresh key per position from the engine's generator (seeded by
``EngineConfig.seed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

GREEDY_EPSILON = 1e-5

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The 64-bit random key of (seed, output position)."""
    return _mix64(_mix64(seeds) + positions)


def uniform_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """One float64 in the open interval (0, 1) per key."""
    bits = _shift_right(_mix64(keys), 11)  # the top 53 bits
    return (bits.to(torch.float64) + 0.5) * (2.0**-53)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but each row's k largest logits; k <= 0 keeps the row unchanged."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).to(torch.int64)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    threshold = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.to(probs.dtype).unsqueeze(-1)
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@dataclass
class SamplingParamsBatch:
    """Per sampled position (length N) — the runner expands per-row parameters to these."""

    temperature: npt.NDArray[np.float32]
    top_p: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int32]
    seeds: npt.NDArray[np.int64]
    output_positions: npt.NDArray[np.int64]
    num_logprobs: npt.NDArray[np.int32]

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature <= GREEDY_EPSILON).all())


@dataclass
class SamplerResult:
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None
    """Per position: (sampled token, its logprob) then the top-n pairs; None when none asked."""


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: torch.Tensor, params: SamplingParamsBatch) -> SamplerResult:
        """logits: [N, vocab] for N sampled positions."""
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if params.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, params)
        token_list = [int(t) for t in tokens.tolist()]
        logprobs = (
            self._logprobs(logits, tokens, params.num_logprobs) if (params.num_logprobs >= 0).any() else None
        )
        return SamplerResult(token_ids=token_list, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, params: SamplingParamsBatch) -> torch.Tensor:
        device = logits.device
        greedy = torch.from_numpy(params.temperature <= GREEDY_EPSILON).to(device)
        temperature = torch.from_numpy(
            np.where(params.temperature <= GREEDY_EPSILON, 1.0, params.temperature)
        )
        scaled = logits / temperature.to(device=device, dtype=logits.dtype).unsqueeze(-1)
        if (params.top_k > 0).any():
            scaled = apply_top_k(scaled, torch.from_numpy(params.top_k.astype(np.int64)).to(device))
        if (params.top_p < 1.0).any():
            scaled = apply_top_p(scaled, torch.from_numpy(params.top_p).to(device))
        keys = self._keys(params).to(device)
        uniform = uniform_from_keys(keys).to(logits.dtype)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        target = (uniform * cdf[:, -1]).unsqueeze(-1)
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _keys(self, params: SamplingParamsBatch) -> torch.Tensor:
        seeded = params.seeds >= 0
        keys = torch.from_numpy(self._rng.integers(0, 2**63 - 1, size=len(params.seeds), dtype=np.int64))
        if seeded.any():
            keyed = position_keys(torch.from_numpy(params.seeds), torch.from_numpy(params.output_positions))
            keys = torch.where(torch.from_numpy(seeded), keyed, keys)
        return keys

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: npt.NDArray[np.int32]
    ) -> list[list[tuple[int, float]]]:
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        top_n = max(int(num_logprobs.max()), 0)
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        result: list[list[tuple[int, float]]] = []
        token_ids = tokens.tolist()
        for row, n in enumerate(num_logprobs.tolist()):
            if n < 0:
                result.append([])
                continue
            entry = [(int(token_ids[row]), float(chosen[row]))]
            if n and top_values is not None and top_ids is not None:
                entry += list(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True))
            result.append(entry)
        return result
