"""Negative controls: the lossless-sampling test passes the real verifier and fails broken ones.

A statistical test that passes is evidence only if it fails when the thing it checks is wrong.
Here the pipeline of `test_lossless_sampling` (a lockstep router, drafter, verifier, in
process; 2,000 seeded requests; its chi-square test at ALPHA = 1e-4) runs three times at the
settings of its `temperature-k1-bonus` case (temperature 1, one draft token per block, two
tokens), once with the real verifier and once with each bug of
`tests.cluster.broken_verifiers`:

- residual not renormalised: a rejected draft token is replaced by a token drawn from the
  unnormalised residual max(0, p - q), or else kept. t1 then follows r p1 + (1 - r) q1 with
  r = TV(p1, q1); t2 follows p2, because a block after a rejection has room for no draft.
- bonus from q: when the draft token is accepted, t2 comes from the drafter's q2(. | t1).
  P(t1, t2) = min(p1, q1)(t1) q2(t2 | t1) + max(0, p1 - q1)(t1) p2(t2 | t1).

Each run must pass the test against the distribution it should produce (the target's for the
real verifier, the closed form above for a broken one: the bug is the one modelled and nothing
else changed), and fail it against the target's exactly when the verifier is broken.

Why a broken verifier's failure is not left to luck: under a broken distribution B, Pearson's
statistic over the test's cells is approximately noncentral chi-square with noncentrality
lambda = n sum_c (B_c - P_c)^2 / P_c, so the test misses the bug with probability
ncx2.cdf(critical value at ALPHA, df, lambda). With n = 2,000 and the tiny pair, lambda is
about 231 for the residual bug (TV(B, P) = 0.18) and 743 for the bonus bug (TV 0.21), against a
critical value of 86 on 43 degrees of freedom: miss probabilities of about 1e-14 and 1e-82. The
test computes this bound and asserts it is below MAX_MISS, so a change of the tiny models that
weakened a control fails here, loudly, instead of making the control flaky.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from scipy import stats
from torch import Tensor

import verifier.step_outcomes
from cluster.local import LocalTandem, local_router
from cluster.routing.router import Router
from cluster.runtime.sampling_params import SamplingParams
from drafter.drafter import draft_sampling
from tests.cluster.broken_verifiers import BonusFromDraftVerifier, residual_not_renormalised
from tests.cluster.routing.test_lossless_sampling import (
    ALPHA,
    NUM_SEEDS,
    chi_square_p_value,
    first_two,
    pooled_cells,
    sample_first_two,
)
from verifier.verifier import Verifier

SAMPLING = SamplingParams(temperature=1.0)
DRAFT_TOKENS, MAX_TOKENS = 1, 2
MAX_MISS = 1e-9
"""Largest tolerated chance that a broken verifier passes the test with these settings."""

Predict = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _target(p1: Tensor, p2: Tensor, q1: Tensor, q2: Tensor) -> Tensor:
    return p1[:, None] * p2


def _residual_not_renormalised(p1: Tensor, p2: Tensor, q1: Tensor, q2: Tensor) -> Tensor:
    rejected = (p1 - q1).clamp(min=0).sum()
    return (rejected * p1 + (1 - rejected) * q1)[:, None] * p2


def _bonus_from_q(p1: Tensor, p2: Tensor, q1: Tensor, q2: Tensor) -> Tensor:
    return torch.minimum(p1, q1)[:, None] * q2 + (p1 - q1).clamp(min=0)[:, None] * p2


PREDICTED: dict[str, Predict] = {
    "real": _target,
    "residual-not-renormalised": _residual_not_renormalised,
    "bonus-from-q": _bonus_from_q,
}


def miss_probability(broken: Tensor, target: Tensor, num_samples: int) -> float:
    """Chance that `num_samples` pairs drawn from `broken` pass the test against `target`
    (noncentral chi-square approximation of Pearson's statistic, on the test's own cells)."""
    observed = pooled_cells(broken, target, num_samples)
    expected = pooled_cells(target, target, num_samples)
    noncentrality = num_samples * ((observed - expected) ** 2 / expected).sum().item()
    df = len(expected) - 1
    return float(stats.ncx2.cdf(stats.chi2.isf(ALPHA, df), df, noncentrality))


@contextmanager
def serial_router(
    kind: str, tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Router]:
    """A lockstep router (`verifier_advances` off: every token, the first included, decided by
    a posted block) over the shared drafter and a fresh verifier of `kind` on the tiny
    target, in serial rounds."""
    candidate: Verifier
    if kind == "bonus-from-q":
        candidate = BonusFromDraftVerifier(tandem.target, tandem.draft, tandem.drafter.config.top_k)
    else:
        if kind == "residual-not-renormalised":
            # The verifier accepts a step's blocks by this module-level name (its step's
            # outcomes, `verifier.step_outcomes`): the only change.
            monkeypatch.setattr(
                verifier.step_outcomes, "batch_rejection_sample", residual_not_renormalised
            )
        candidate = Verifier(tandem.target)
    router = local_router(
        candidate, tandem.drafter, tandem.target, pipelined=False, verifier_advances=False
    )
    try:
        yield router
    finally:
        router.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PREDICTED))
def test_the_lossless_test_passes_only_the_real_verifier(
    local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    p1, p2 = (t.double() for t in first_two(local_tandem.target, SAMPLING))
    drafter_sampling = draft_sampling(SAMPLING, local_tandem.drafter.config.top_k)
    q1, q2 = (t.double() for t in first_two(local_tandem.draft, drafter_sampling))
    target, predicted = p1[:, None] * p2, PREDICTED[kind](p1, p2, q1, q2)
    if kind != "real":
        assert miss_probability(predicted, target, NUM_SEEDS) < MAX_MISS

    with serial_router(kind, local_tandem, monkeypatch) as router:
        vocab = local_tandem.target.vocab_size
        counts, tally = sample_first_two(router, vocab, SAMPLING, DRAFT_TOKENS, MAX_TOKENS, False)
    assert 0 < tally.accepted < tally.drafted  # bonus and recovered tokens were both drawn
    assert chi_square_p_value(counts, predicted) > ALPHA  # it is this bug, and only it
    passes = chi_square_p_value(counts, target) > ALPHA
    assert passes == (kind == "real")
