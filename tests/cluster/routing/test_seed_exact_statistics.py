"""The seed-exact rule is still lossless, and the statistic catches the faults it should.

As in `test_lossless_sampling`: for PROMPT, the target's exact joint distribution of the first
two generated tokens, P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) (temperature and top-p
applied), against the pairs the in-process router emits over NUM_SEEDS = 2,000 seeded requests,
by Pearson's chi-square with cells expected fewer than 5 times pooled. Here every request
follows the seed-exact rule (`SamplingParams.seed_exact`), on a lockstep router
(`verifier_advances` off: the first token drafted too, every token decided by a posted block)
and drafts both accepted and rejected.

Bound: the seeds are fixed, so each test is deterministic; under a correct sampler the p-value
is (asymptotically) uniform, so it falls below ALPHA = 1e-4 for one set of seeds in 10,000.

Negative controls, verifiers broken on purpose (`tests.cluster.broken_verifiers`):
- `reused_noise`: the target's draw at every position uses the noise of position 0, so t2 is
  drawn with the very noise that chose t1: t1 = argmax p1 / E, t2 = argmax p2(. | t1) / E for
  one Exp(1) vector E. That joint law is computed here by Monte Carlo (MC_DRAWS noise vectors)
  and its distance from P bounds, as in `test_negative_controls`, the chance that the test
  misses the bug (noncentral chi-square), asserted below MAX_MISS; the run must fail the test
  against P and pass it against the law it is modelled by.
- `draft_stream`: a block with drafts draws the target's tokens from the rejection rule's
  drafter noise stream (the seed salted), a block without from the request's own. Every draw
  still uses fresh noise independent of what it is compared with, so the output is still an
  exact sample: the chi-square passes, and must. What it breaks is seed-exactness: the tokens
  depend on how the request was drafted, so they differ from `reference_generate` (for some of
  a few seeds), and from the same request's tokens with no drafts, which still equal it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.tools.baselines.hf_reference import reference_generate
from tests.cluster.broken_verifiers import DraftStreamVerifier, ReusedNoiseVerifier, local_with
from tests.cluster.routing.lockstep_routers import held_lockstep_router
from tests.cluster.routing.test_lossless_sampling import (
    ALPHA,
    NUM_SEEDS,
    PROMPT,
    chi_square_p_value,
    first_two,
    joint_first_two,
    sample_first_two,
)
from tests.cluster.routing.test_negative_controls import miss_probability
from verifier.verifier import Verifier

SAMPLING = SamplingParams(temperature=1.5, seed_exact=True)
"""A flat setting: reused noise then draws t2 == t1 ten times as often as the target (10% of
pairs against 0.8%), where at temperature 1 (4.5% against 0.5%) the excess is spread over
cells the test pools, and the test would miss the bug with probability 7e-6 instead of 2e-69."""
DRAFT_TOKENS, MAX_TOKENS = 2, 3
"""Two drafts per block: t2 is an accepted draft, a correction, or the next round's."""
MAX_MISS = 1e-9
"""Largest tolerated chance that the `reused_noise` verifier passes the test."""
MC_DRAWS = 400_000
"""Noise vectors of the Monte Carlo model of `reused_noise`: its variance is 1/200 of that of
the test's own 2,000 samples."""


def faulty(verifier_type: type[Verifier]) -> Iterator[LocalTandem]:
    """The tiny pair with a `verifier_type` verifier, its router a lockstep one: the first
    token goes through the draft path too."""
    tandem = local_with(verifier_type, verifier_advances=False)
    yield tandem
    tandem.router.close()
    tandem.verifier.close()
    tandem.drafter.close()


@pytest.fixture(scope="module")
def reused_noise() -> Iterator[LocalTandem]:
    yield from faulty(ReusedNoiseVerifier)


@pytest.fixture(scope="module")
def draft_stream() -> Iterator[LocalTandem]:
    yield from faulty(DraftStreamVerifier)


def reused_noise_joint(model: LoadedModel, sampling: SamplingParams) -> Tensor:
    """P(t1, t2) `[vocab, vocab]` when both are drawn with one noise vector: t1 = argmax
    p1 / E, t2 = argmax p2(. | t1) / E, E ~ Exp(1)^vocab; by Monte Carlo (MC_DRAWS vectors)."""
    p1, p2 = (t.double() for t in first_two(model, sampling))  # [vocab], [vocab, vocab]
    vocab = p1.shape[0]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for _ in range(MC_DRAWS // 20_000):
        noise = torch.empty(20_000, vocab, dtype=torch.float64).exponential_(generator=generator)
        t1 = (p1 / noise).argmax(-1)  # [20000]
        t2 = (p2[t1] / noise).argmax(-1)  # [20000]
        counts += torch.bincount(t1 * vocab + t2, minlength=vocab * vocab).double()
    return (counts / MC_DRAWS).reshape(vocab, vocab)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampling", "draft_tokens", "pipelined"),
    [
        (SAMPLING, DRAFT_TOKENS, False),  # temperature 1.5
        # Pipelined: a block drafted ahead is checked against the target's draws at its
        # positions; top-p truncates both the target's and the drafter's distributions.
        (SamplingParams(temperature=1.0, top_p=0.8, seed_exact=True), 1, True),
    ],
    ids=["temperature1.5-k2", "pipelined-top-p"],
)
def test_seed_exact_first_two_tokens_follow_the_target(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    sampling: SamplingParams,
    draft_tokens: int,
    pipelined: bool,
) -> None:
    # Lockstep, its pipelined blocks verified ahead of their predecessors' verdicts.
    router = held_lockstep_router(local_tandem.verifier, local_tandem.drafter, local_tandem.target)
    try:
        counts, tally = sample_first_two(
            router, tiny_target.vocab_size, sampling, draft_tokens, MAX_TOKENS, pipelined
        )
    finally:
        router.close()
    assert 0 < tally.accepted < tally.drafted  # drafts were accepted and rejected
    assert (tally.pipeline_hits > 0) == pipelined
    assert chi_square_p_value(counts, joint_first_two(tiny_target, sampling)) > ALPHA


@pytest.mark.slow
def test_reused_noise_fails_the_lossless_test(
    reused_noise: LocalTandem, tiny_target: LoadedModel
) -> None:
    target = joint_first_two(tiny_target, SAMPLING).double()
    broken = reused_noise_joint(tiny_target, SAMPLING)
    assert miss_probability(broken, target, NUM_SEEDS) < MAX_MISS  # the test has the power
    counts, tally = sample_first_two(
        reused_noise.router, tiny_target.vocab_size, SAMPLING, DRAFT_TOKENS, MAX_TOKENS, False
    )
    assert tally.drafted > 0
    # It is this bug, and only it. (Mixed with a thousandth of P, so that a pair too rare to
    # appear among the Monte Carlo draws is not an "impossible" one; the mixture moves the
    # statistic by far less than its own noise.)
    assert chi_square_p_value(counts, 0.999 * broken + 0.001 * target) > ALPHA
    assert chi_square_p_value(counts, target) < ALPHA


@pytest.mark.slow
def test_draft_stream_is_still_an_exact_sample(
    draft_stream: LocalTandem, tiny_target: LoadedModel
) -> None:
    counts, tally = sample_first_two(
        draft_stream.router, tiny_target.vocab_size, SAMPLING, DRAFT_TOKENS, MAX_TOKENS, False
    )
    assert 0 < tally.accepted < tally.drafted
    assert chi_square_p_value(counts, joint_first_two(tiny_target, SAMPLING)) > ALPHA


def test_draft_stream_is_not_seed_exact(
    draft_stream: LocalTandem, tiny_target: LoadedModel
) -> None:
    """Not statistical (no slow mark): equality with the reference on a few seeds."""
    router, max_tokens = draft_stream.router, 16
    differs_with_drafts = 0
    for seed in range(8):
        expected = reference_generate(
            tiny_target, PROMPT, max_tokens, SAMPLING, seed, sorted(tiny_target.eos_token_ids)
        )
        plain, drafted = (
            router.generate(
                GenerationRequest(PROMPT, max_tokens, SAMPLING, seed=seed, draft_tokens=k),
                pipelined=False,
            ).tokens
            for k in (0, DRAFT_TOKENS)
        )
        assert plain == expected  # blocks without drafts use the request's own noise
        differs_with_drafts += drafted != expected
    assert differs_with_drafts > 0
