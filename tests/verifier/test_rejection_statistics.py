"""Tests for verifier.rejection, kind 4 of docs/architecture.md, "Tests": statistics. Emitted
tokens are distributed as the target over many seeded trials, and the same statistic catches a
wrong sampler (exact
cases, determinism and the loop reference are in test_rejection.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chi2
from torch import Tensor

from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from tests.verifier.rejection_reference import (
    Sampler,
    reference_rejection_sample,
    seeded,
)
from verifier.rejection import rejection_sample

NUM_TRIALS = 15_000  # about 2.5 s per case on a 2-core box
STAT_VOCAB = 6
ALPHA = 1e-4  # fail when the p-value is below this
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled, as Pearson's approximation needs


@dataclass(frozen=True)
class _Case:
    name: str
    target: SamplingParams
    draft: SamplingParams | None  # None: a deterministic (argmax) drafter that sends no q
    seed: int


STAT_CASES = [
    _Case("temperature", SamplingParams(temperature=0.7), SamplingParams(temperature=1.3), 1),
    _Case(
        "top-k",
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.8, top_k=4),
        2,
    ),
    _Case(
        "top-p",
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9),
        3,
    ),
    _Case("deterministic-draft", SamplingParams(temperature=1.0), None, 4),
]


def _case_distributions(case: _Case) -> tuple[Tensor, Tensor, Tensor | None]:
    """Target rows p_1..p_3, and the draft rows q_1, q_2 (or fixed argmax drafts, q = None)."""
    gen = seeded(case.seed)
    target_logits = 1.5 * torch.randn(3, STAT_VOCAB, generator=gen)  # [k + 1, vocab], k = 2
    # Correlated with the target, as a smaller model of the same family would be, but not equal.
    draft_logits = target_logits[:2] + torch.randn(2, STAT_VOCAB, generator=gen)  # [k, vocab]
    target = logits_to_probs(target_logits, case.target)
    if case.draft is None:
        return target, draft_logits.argmax(dim=-1), None
    draft_probs = logits_to_probs(draft_logits, case.draft)
    return target, torch.empty(0, dtype=torch.int64), draft_probs


def _emitted_triples(
    sampler: Sampler,
    target: Tensor,  # [3, vocab]
    fixed_draft: Tensor,  # [2], used when draft_probs is None
    draft_probs: Tensor | None,  # [2, vocab]
    gen: torch.Generator,
) -> Tensor:  # [NUM_TRIALS, 3]
    """The tokens at the three positions one k = 2 round covers, one row per trial.

    A round that stops early emits fewer than three; a new round would start right after its
    last token. The target rows here do not depend on earlier tokens, so whatever that round
    emits must be distributed as p at its position, and a direct sample from p stands in.
    """
    fresh = torch.multinomial(target, NUM_TRIALS, replacement=True, generator=gen).T
    if draft_probs is None:
        drafts = fixed_draft.expand(NUM_TRIALS, 2)
    else:
        drafts = torch.multinomial(draft_probs, NUM_TRIALS, replacement=True, generator=gen).T
    emitted = fresh.clone()
    for trial in range(NUM_TRIALS):
        tokens, num_accepted = sampler(target, drafts[trial], draft_probs, gen)
        emitted[trial, : num_accepted + 1] = tokens
    return emitted


def _chi_square_p_value(emitted: Tensor, target: Tensor) -> float:  # [n, 3], [3, vocab]
    """Pearson's test of the emitted triples against p_1 x p_2 x p_3 over vocab**3 cells."""
    vocab = target.shape[1]
    cells = (emitted[:, 0] * vocab + emitted[:, 1]) * vocab + emitted[:, 2]
    observed = torch.bincount(cells, minlength=vocab**3).double()
    p1, p2, p3 = target.double()
    probs = torch.einsum("a,b,c->abc", p1, p2, p3).flatten()
    impossible = probs == 0
    assert int(observed[impossible].sum()) == 0, "emitted a token the target excludes"
    expected_counts = probs[~impossible] * len(emitted)
    order = expected_counts.argsort()
    expected: list[float] = expected_counts[order].tolist()
    observed_counts: list[float] = observed[~impossible][order].tolist()
    pooled = 0  # the smallest cells, pooled until the pool and every other cell reach the bar
    while pooled < len(expected) and (
        expected[pooled] < MIN_EXPECTED or 0 < sum(expected[:pooled]) < MIN_EXPECTED
    ):
        pooled += 1
    bins_expected = ([sum(expected[:pooled])] if pooled else []) + expected[pooled:]
    bins_observed = ([sum(observed_counts[:pooled])] if pooled else []) + observed_counts[pooled:]
    statistic = sum((o - e) ** 2 / e for o, e in zip(bins_observed, bins_expected, strict=True))
    return float(chi2.sf(statistic, df=len(bins_expected) - 1))


@pytest.mark.parametrize("case", STAT_CASES, ids=[case.name for case in STAT_CASES])
def test_emitted_tokens_are_distributed_as_the_target(case: _Case) -> None:
    """(t1, t2, t3) from k = 2 rounds must follow p_1 x p_2 x p_3 (accepted, recovered, bonus).

    False-failure odds: trials are independent draws, so under a correct sampler Pearson's
    statistic is (asymptotically) chi-square with bins - 1 degrees of freedom and its p-value
    uniform; a given seed fails with probability ALPHA = 1e-4 per case. The seed is fixed, so
    the test never flakes: it passes on every run or, with those odds, on none.

    Power: the statistic's noncentrality is NUM_TRIALS * chi2(actual || p) >= 4 * NUM_TRIALS *
    TV**2, so with 15,000 trials and at most 215 degrees of freedom any deviation of total
    variation >= 0.052 on the pooled cells is caught with probability >= 99% (noncentral
    chi-square). The wrong samplers below are caught by the same statistic.
    """
    target, fixed_draft, draft_probs = _case_distributions(case)
    if draft_probs is not None:
        assert not torch.allclose(target[:2], draft_probs, atol=0.05)  # q really differs from p
    emitted = _emitted_triples(rejection_sample, target, fixed_draft, draft_probs, seeded(99))
    assert _chi_square_p_value(emitted, target) >= ALPHA


def _recovers_from_the_target(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Wrong: at a rejection it samples from p instead of norm(max(0, p - q))."""
    assert draft_probs is not None
    u = torch.rand(len(draft), generator=gen)
    for i, x in enumerate(draft.tolist()):
        if not bool(u[i] < target[i, x] / draft_probs[i, x]):
            return torch.cat([draft[:i], torch.multinomial(target[i], 1, generator=gen)]), i
    return torch.cat([draft, torch.multinomial(target[-1], 1, generator=gen)]), len(draft)


def _bonus_from_the_last_draft_row(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Wrong: an off-by-one samples the bonus token from p_k instead of p_(k+1)."""
    tokens, num_accepted = reference_rejection_sample(target, draft, draft_probs, gen)
    if num_accepted < len(draft):
        return tokens, num_accepted
    return torch.cat([draft, torch.multinomial(target[-2], 1, generator=gen)]), num_accepted


@pytest.mark.parametrize(
    "wrong_sampler", [_recovers_from_the_target, _bonus_from_the_last_draft_row]
)
def test_the_statistic_catches_a_wrong_sampler(wrong_sampler: Sampler) -> None:
    """Negative control: the test above can fail, on the same case, seed and statistic."""
    target, fixed_draft, draft_probs = _case_distributions(STAT_CASES[0])
    emitted = _emitted_triples(wrong_sampler, target, fixed_draft, draft_probs, seeded(99))
    assert _chi_square_p_value(emitted, target) < ALPHA
