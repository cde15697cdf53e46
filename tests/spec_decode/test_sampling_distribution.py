"""Sampling with speculation keeps the model's distribution exactly.

The verifier accepts a draft t where the target's own sample at that output position, drawn with
the position's random number, equals t, and otherwise emits that sample. For a point-mass draft
this is rejection sampling: t is kept with probability p(t), and on rejection the token is
distributed as p with t removed and renormalised (max(p - q, 0) normalised). Since a seeded
request's random number depends only on (seed, output position), its tokens are even identical
with speculation on and off.

Checked on a 4-token vocabulary: the joint distribution of the first four output tokens (two
drafts verified in one forward after the first token) against the exact probabilities from
transformers, with a chi-squared test at a fixed significance over fixed seeds (deterministic, so
CI is stable); a control shows the test does reject a slightly different distribution.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from baton_engine.core.sampling_params import SamplingParams
from baton_support.tiny_models import TinyModel
from tests.spec_decode.runs import Run, generate, make_llm

VOCAB = 4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # the n-gram drafter proposes [3, 1, ...] after it
NUM_TOKENS = 4
NUM_SAMPLES = 6000
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("spec-chi2") / "llama"
    TinyModel(vocab_size=VOCAB, seed=3, init_range=0.5).save(directory)
    return directory


def exact_joint(model_dir: Path, temperature: float, top_k: int = -1) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS output tokens) under temperature and top-k, from transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    continuations = list(itertools.product(range(VOCAB), repeat=NUM_TOKENS - 1))
    ids = torch.tensor([PROMPT + list(c) for c in continuations])
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1 :] / temperature  # [n, NUM_TOKENS, vocab]
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    joint: dict[tuple[int, ...], float] = {}
    for row, prefix in enumerate(continuations):
        for last in range(VOCAB):
            tokens = (*prefix, last)
            p = 1.0
            for i, token in enumerate(tokens):
                p *= float(probs[row, i, token])
            joint[tokens] = p
    return joint


def chi_squared_p_value(
    counts: dict[tuple[int, ...], int], expected_probs: dict[tuple[int, ...], float]
) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled into one bin."""
    n = sum(counts.values())
    assert set(counts) <= {k for k, p in expected_probs.items() if p > 0}, (
        "an impossible sequence was sampled"
    )
    bins: list[tuple[float, int]] = []
    pooled_expected, pooled_observed = 0.0, 0
    for outcome, p in expected_probs.items():
        if n * p >= 5:
            bins.append((n * p, counts.get(outcome, 0)))
        else:
            pooled_expected += n * p
            pooled_observed += counts.get(outcome, 0)
    if pooled_expected > 0:
        bins.append((pooled_expected, pooled_observed))
    statistic = sum((observed - expected) ** 2 / expected for expected, observed in bins)
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def histogram(run: Run) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for tokens in run.token_ids():
        assert len(tokens) == NUM_TOKENS
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def sample(model_dir: Path, k: int, temperature: float, top_k: int, seeded: bool) -> Run:
    params = [
        SamplingParams(
            temperature=temperature, top_k=top_k, max_tokens=NUM_TOKENS, seed=i if seeded else None
        )
        for i in range(NUM_SAMPLES)
    ]
    llm = make_llm(str(model_dir), k=k, max_num_seqs=256, max_num_batched_tokens=4096, seed=1234)
    return generate(llm, [PROMPT] * NUM_SAMPLES, params)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "top_k", "seeded"),
    [(1.0, -1, True), (1.0, -1, False), (0.7, 3, True)],
    ids=["seeded", "unseeded", "seeded-t0.7-topk3"],
)
def test_speculative_sampling_matches_the_model_distribution(
    small_vocab_model: Path, temperature: float, top_k: int, seeded: bool
) -> None:
    run = sample(small_vocab_model, 3, temperature, top_k, seeded)
    # Verification really happened, with acceptances at both draft positions and rejections.
    stats = run.stats
    assert stats.spec_num_drafts >= NUM_SAMPLES
    first, second = stats.spec_accepted_per_position[:2]
    assert 200 < second < first < stats.spec_num_drafts - 200
    counts = histogram(run)
    assert chi_squared_p_value(counts, exact_joint(small_vocab_model, temperature, top_k)) > SIGNIFICANCE
    # Control: the same samples against a slightly hotter distribution are rejected.
    assert (
        chi_squared_p_value(counts, exact_joint(small_vocab_model, temperature * 1.15, top_k)) < SIGNIFICANCE
    )


@pytest.mark.slow
def test_seeded_samples_are_identical_with_and_without_speculation(small_vocab_model: Path) -> None:
    on = sample(small_vocab_model, 3, 1.0, -1, seeded=True)
    off = sample(small_vocab_model, 0, 1.0, -1, seeded=True)
    assert on.token_ids() == off.token_ids()
    assert on.stats.spec_accepted_tokens > 0 and off.stats.spec_num_drafts == 0
