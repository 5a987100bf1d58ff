"""Sampling through the whole pipeline is distributed exactly as sampling the target alone.

For a fixed prompt we compute the target's exact joint distribution of the first two generated
tokens, P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1), with the request's temperature and
top-p applied (the distributions actually sampled from). Then we run the in-process router,
drafter and verifier once per seed and compare the observed (t1, t2) pairs with P by Pearson's
chi-square test. The router is a lockstep one (`verifier_advances` off): every token, the
first included, is decided by a posted block, drafted or (where the plan drafts none) empty;
where a verifier session runs, in-process the tiny verifier mostly takes the tokens alone
before the tiny drafter's blocks arrive, and drafted tokens would rarely decide t1 or t2. Its
verifier holds a pipelined block until the block drafted ahead of it is posted
(`tests.cluster.routing.lockstep_routers`), so that pipelined cases verify blocks ahead, as a
verifier slower than its drafter does.

Bound and false-failure odds: the seeds are fixed; which path a pipelined block takes (verified
ahead, or rebased after its predecessor's verdict) may depend on timing, and every path is
exact, so the question is how likely it is that a correct sampler fails for one set of seeds.
Under a correct sampler the chi-square p-value is (asymptotically) uniform on [0, 1], so it
falls below ALPHA = 1e-4 with probability 1e-4. Cells whose expected count is below 5 are
pooled into one cell, which keeps the chi-square approximation sound. Power: the negative
control below runs the same statistic on pairs drawn from the draft model alone (what a
pipeline that emitted drafts unchecked would produce) and needs the p-value far below ALPHA,
so the test can fail; and `test_negative_controls.py` drives verifiers with a deliberately
broken acceptance rule through the same (lockstep) router and helpers, and each must fail it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from tests.cluster.routing.lockstep_routers import held_lockstep_router

ALPHA = 1e-4
NUM_SEEDS = 2000
MIN_EXPECTED = 5.0
PROMPT = tuple(b"def add(a, b):")
CONCURRENT_REQUESTS = 16
"""Seeded requests in flight at once: the engines batch them into shared forward passes."""


def first_two(model: LoadedModel, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s distributions of the first two tokens, as sampled with `sampling`:
    p(t1 | prompt) `[vocab]` and p(t2 | prompt, t1) `[vocab, vocab]` (row t1)."""
    vocab = model.vocab_size
    with torch.inference_mode():
        first = model.model(torch.tensor([PROMPT])).logits[:, -1]  # [1, vocab]
        p1 = logits_to_probs(first, sampling)[0]  # [vocab]
        contexts = torch.tensor([[*PROMPT, t] for t in range(vocab)])  # [vocab, len + 1]
        second = model.model(contexts).logits[:, -1]  # [vocab, vocab]
        p2 = logits_to_probs(second, sampling)  # [vocab, vocab], row t1
    return p1, p2


def joint_first_two(model: LoadedModel, sampling: SamplingParams) -> torch.Tensor:
    """Exact P(t1, t2) of sampling `model` alone: `[vocab, vocab]`."""
    p1, p2 = first_two(model, sampling)
    return p1[:, None] * p2


@dataclass
class Tally:
    """Speculation counters summed over the seeded requests."""

    drafted: int = 0
    accepted: int = 0
    pipeline_hits: int = 0


def sample_first_two(
    router: Router,
    vocab: int,
    sampling: SamplingParams,
    draft_tokens: int,
    max_tokens: int,
    pipelined: bool,
) -> tuple[torch.Tensor, Tally]:
    """Counts `[vocab, vocab]` of the first two tokens `router` emits for PROMPT over
    NUM_SEEDS seeded requests, and their speculation counters."""
    requests = [
        GenerationRequest(PROMPT, max_tokens, sampling, seed=seed, draft_tokens=draft_tokens)
        for seed in range(NUM_SEEDS)
    ]
    # Submitted together, the requests share the engines' forward passes; each draws only from
    # its own seeded generator, so a seed's tokens do not depend on what it was batched with.
    with ThreadPoolExecutor(max_workers=CONCURRENT_REQUESTS) as pool:
        results = list(pool.map(lambda r: router.generate(r, pipelined=pipelined), requests))
    counts = torch.zeros(vocab, vocab)
    tally = Tally()
    for result in results:
        counts[result.tokens[0], result.tokens[1]] += 1
        tally.drafted += result.stats.num_drafted
        tally.accepted += result.stats.num_accepted
        tally.pipeline_hits += result.stats.pipeline_hits
    return counts, tally


def pooled_cells(values: torch.Tensor, probs: torch.Tensor, num_samples: int) -> torch.Tensor:
    """`values` (shaped like `probs`) summed into the test's cells: one per outcome whose
    expected count under `probs` is at least MIN_EXPECTED, then one for the other outcomes
    `probs` allows; outcomes it excludes are left out."""
    values, probs = values.flatten().double(), probs.flatten().double()
    allowed = probs > 0
    values, expected = values[allowed], probs[allowed] * num_samples
    big = expected >= MIN_EXPECTED
    cells = values[big]
    if (~big).any():
        cells = torch.cat([cells, values[~big].sum()[None]])
    return cells


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts against probabilities (same shape)."""
    # A sample outside the target's support is a hard failure, not a statistical one.
    outside = counts.flatten()[expected_probs.flatten() == 0].sum()
    assert outside == 0, "sampled a token the target cannot produce"
    num_samples = int(counts.sum())
    observed = pooled_cells(counts, expected_probs, num_samples)
    expected = pooled_cells(expected_probs, expected_probs, num_samples) * num_samples
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    return float(stats.chi2.sf(statistic, df=len(observed) - 1))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampling", "draft_tokens", "max_tokens", "pipelined"),
    [
        # Two drafts per block: t2 is an accepted or recovered draft, or from a second round.
        (SamplingParams(temperature=1.0), 2, 3, False),
        # One draft per block: t2 is often the bonus token.
        (SamplingParams(temperature=1.0), 1, 2, False),
        # Nucleus sampling: both p and q are truncated to their top-p sets.
        (SamplingParams(temperature=1.0, top_p=0.8), 3, 4, False),
        # Pipelined: when t1 is accepted the bonus is deferred, and t2 is the block drafted
        # ahead, checked against the kept target distribution.
        (SamplingParams(temperature=1.0), 1, 3, True),
        (SamplingParams(temperature=1.0, top_p=0.8), 1, 3, True),
    ],
    ids=["temperature-k2", "temperature-k1-bonus", "top-p-k3", "pipelined", "pipelined-top-p"],
)
def test_first_two_tokens_follow_the_target(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    sampling: SamplingParams,
    draft_tokens: int,
    max_tokens: int,
    pipelined: bool,
) -> None:
    # The first token must come through the draft path too, not from the target alone.
    router = held_lockstep_router(local_tandem.verifier, local_tandem.drafter, local_tandem.target)
    try:
        counts, tally = sample_first_two(
            router, tiny_target.vocab_size, sampling, draft_tokens, max_tokens, pipelined
        )
    finally:
        router.close()
    assert 0 < tally.accepted < tally.drafted  # both acceptance and rejection paths were taken
    assert (tally.pipeline_hits > 0) == pipelined
    assert chi_square_p_value(counts, joint_first_two(tiny_target, sampling)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampling", "draft_tokens", "max_tokens", "pipelined"),
    [
        (SamplingParams(temperature=1.0), 2, 3, False),
        (SamplingParams(temperature=1.0, top_p=0.8), 1, 3, True),
    ],
    ids=["temperature-k2", "pipelined-top-p"],
)
def test_a_trimmed_draft_vocabulary_keeps_sampling_exact(
    trimmed_tandem: LocalTandem,
    tiny_target: LoadedModel,
    sampling: SamplingParams,
    draft_tokens: int,
    max_tokens: int,
    pipelined: bool,
) -> None:
    """The draft scores only its kept ids (q is zero elsewhere); tokens outside them still come
    from the target, as residual draws or bonus tokens, and the pairs follow the target."""
    router = held_lockstep_router(
        trimmed_tandem.verifier, trimmed_tandem.drafter, trimmed_tandem.target
    )
    try:
        counts, tally = sample_first_two(
            router, tiny_target.vocab_size, sampling, draft_tokens, max_tokens, pipelined
        )
    finally:
        router.close()
    assert 0 < tally.accepted < tally.drafted
    kept = trimmed_tandem.draft.model.get_output_embeddings().kept
    outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    outside[kept] = False
    assert counts[outside].sum() > 0  # the target produced ids the draft cannot propose
    assert chi_square_p_value(counts, joint_first_two(tiny_target, sampling)) > ALPHA


def test_statistic_detects_unchecked_drafts(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    """Negative control: pairs from the draft model alone are rejected by the same test."""
    sampling = SamplingParams(temperature=1.0)
    draft_joint = joint_first_two(tiny_draft, sampling).flatten()
    generator = torch.Generator().manual_seed(0)
    pairs = torch.multinomial(draft_joint, NUM_SEEDS, replacement=True, generator=generator)
    counts = torch.bincount(pairs, minlength=draft_joint.numel()).reshape(draft_joint.shape[0], -1)
    target_joint = joint_first_two(tiny_target, sampling)
    # Without truncation every pair is in the target's support: the statistic itself rejects.
    assert chi_square_p_value(counts, target_joint) < ALPHA
