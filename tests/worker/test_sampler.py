"""Sampler: masks on known logits, logprobs, and seeded streams keyed by output position."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from baton_engine.worker.sampler import (
    Sampler,
    SamplingParamsBatch,
    apply_top_k,
    apply_top_p,
    position_keys,
    uniform_from_keys,
)

INF = float("-inf")
MASK64 = (1 << 64) - 1


def _splitmix_reference(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _uniform_reference(seed: int, position: int) -> float:
    key = _splitmix_reference((_splitmix_reference(seed & MASK64) + position) & MASK64)
    return ((_splitmix_reference(key) >> 11) + 0.5) * 2.0**-53


def _params(n: int, **overrides: object) -> SamplingParamsBatch:
    values: dict[str, object] = dict(
        temperature=np.zeros(n, np.float32),
        top_p=np.ones(n, np.float32),
        top_k=np.full(n, -1, np.int32),
        seeds=np.full(n, -1, np.int64),
        output_positions=np.zeros(n, np.int64),
        num_logprobs=np.full(n, -1, np.int32),
    )
    for key, value in overrides.items():
        values[key] = np.asarray(value, dtype=np.asarray(values[key]).dtype)
    return SamplingParamsBatch(**values)  # type: ignore[arg-type]


def test_position_keyed_uniforms_match_a_pure_python_splitmix() -> None:
    seeds = [0, 1, 7, 123456789, 2**62 + 12345, 2**63 - 1]
    positions = [0, 1, 2, 17, 4095]
    pairs = [(s, p) for s in seeds for p in positions]
    keys = position_keys(torch.tensor([s for s, _ in pairs]), torch.tensor([p for _, p in pairs]))
    got = uniform_from_keys(keys).tolist()
    assert got == [_uniform_reference(s, p) for s, p in pairs]
    assert all(0.0 < u < 1.0 for u in got)
    # Pinned values: the stream must never change across versions (a P/D pair may mix them).
    pinned = uniform_from_keys(position_keys(torch.tensor([7, 7, 7]), torch.tensor([0, 1, 2]))).tolist()
    assert pinned == [0.6093945245681751, 0.98355711333702, 0.3749037601024869]


def test_top_k_masks_all_but_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0], [1.0, 5.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    masked = apply_top_k(logits, torch.tensor([2, -1, 9]))
    assert masked.tolist() == [[INF, 5.0, 3.0, INF], [1.0, 5.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)
    logits = probs.log().repeat(4, 1)
    masked = apply_top_p(logits, torch.tensor([0.5, 0.7, 0.81, 1.0]))
    kept = (masked > INF).tolist()
    assert kept == [
        [False, True, False, False],  # 0.5 alone reaches 0.5
        [False, True, False, True],  # 0.5 + 0.3 = 0.8 >= 0.7
        [False, True, True, True],  # 0.8 < 0.81, so 0.15 joins
        [True, True, True, True],
    ]


def test_top_p_always_keeps_the_most_likely_token() -> None:
    masked = apply_top_p(torch.tensor([[0.0, 10.0, 1.0]]), torch.tensor([1e-6]))
    assert (masked > INF).tolist() == [[False, True, False]]


def test_greedy_rows_take_the_argmax() -> None:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.5]])
    assert sampler.sample(logits, _params(2)).token_ids == [1, 0]


def test_seeded_rows_depend_only_on_seed_and_position() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=generator).repeat(64, 1)
    positions = np.arange(64)
    params = _params(64, temperature=np.full(64, 1.0), seeds=np.full(64, 42), output_positions=positions)
    alone = Sampler(seed=1, device=torch.device("cpu")).sample(logits, params).token_ids
    # The same (seed, position) pairs in another order, another batch, another engine seed.
    order = np.random.default_rng(5).permutation(64)
    shuffled_params = _params(
        64, temperature=np.full(64, 1.0), seeds=np.full(64, 42), output_positions=positions[order]
    )
    shuffled = Sampler(seed=99, device=torch.device("cpu")).sample(logits, shuffled_params).token_ids
    assert [shuffled[list(order).index(i)] for i in range(64)] == alone
    assert len(set(alone)) > 5  # the positions draw different tokens
    other_seed = _params(64, temperature=np.full(64, 1.0), seeds=np.full(64, 43), output_positions=positions)
    assert Sampler(seed=1, device=torch.device("cpu")).sample(logits, other_seed).token_ids != alone


def test_seeded_sample_inverts_the_cdf_of_the_scaled_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = _params(1, temperature=[0.5], seeds=[7], output_positions=[1])
    token = Sampler(seed=0, device=torch.device("cpu")).sample(logits, params).token_ids[0]
    probs = torch.softmax(logits[0] / 0.5, dim=-1).tolist()
    u = _uniform_reference(7, 1)  # 0.9835...
    cumulative, expected = 0.0, -1
    for index, p in enumerate(probs):
        cumulative += p
        if u < cumulative:
            expected = index
            break
    assert token == expected == 3
    params = _params(1, temperature=[0.5], seeds=[7], output_positions=[2])  # u = 0.3749...
    assert Sampler(seed=0, device=torch.device("cpu")).sample(logits, params).token_ids == [3]
    params = _params(1, temperature=[2.0], seeds=[7], output_positions=[2])
    assert Sampler(seed=0, device=torch.device("cpu")).sample(logits, params).token_ids == [2]


def test_top_k_one_is_greedy_even_when_sampling() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    params = _params(8, temperature=np.full(8, 1.5), top_k=np.full(8, 1), output_positions=np.arange(8))
    tokens = Sampler(seed=0, device=torch.device("cpu")).sample(logits, params).token_ids
    assert tokens == logits.argmax(dim=-1).tolist()


def test_unseeded_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().repeat(n, 1)
    params = _params(n, temperature=np.ones(n))
    tokens = Sampler(seed=0, device=torch.device("cpu")).sample(logits, params).token_ids
    frequencies = np.bincount(tokens, minlength=4) / n
    assert np.abs(frequencies - probs.numpy()).max() < 0.03


def test_logprobs_hold_the_sampled_token_then_the_top_n() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]], dtype=torch.float64)
    params = _params(2, num_logprobs=[2, 0])
    result = Sampler(seed=0, device=torch.device("cpu")).sample(logits, params)
    assert result.token_ids == [1, 3]
    assert result.logprobs is not None
    log_z0 = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    first = result.logprobs[0]
    assert [t for t, _ in first] == [1, 1, 2]
    assert first[0][1] == pytest.approx(3.0 - log_z0, abs=1e-12)
    assert first[2][1] == pytest.approx(2.0 - log_z0, abs=1e-12)
    assert len(result.logprobs[1]) == 1 and result.logprobs[1][0][0] == 3


def test_no_logprobs_unless_asked() -> None:
    result = Sampler(seed=0, device=torch.device("cpu")).sample(torch.zeros(2, 4), _params(2))
    assert result.logprobs is None
