"""Negative controls for pre-drafting: what a wrong branch cache does, and which test sees it.

1. A wrong hit (the first branch verified next whatever the verdict, drafted for an outcome
   that did not happen) cannot change a greedy or seed-exact request's output: the verifier
   checks every proposal by equality with the target's own token, so a wrong block is merely
   rejected. Output equality therefore cannot catch such a cache, and the test says so (the
   outputs stay equal); what catches it is acceptance: the wrong blocks are accepted far less
   than the right ones (and `tests/drafter/test_branches.py` checks each branch is what the
   drafter drafts after its outcome's prefix).
2. A cache that hands the verifier the wrong q for a sampled branch's tokens (the q's of
   another branch: the tokens were not drawn from what is reported) breaks the rejection
   rule's premise, and the chi-square test of `test_predraft_sampling.py` must reject it.
   (A wrong hit that keeps each block with its own q would not: a block drawn from the q it
   reports, independently of the verdict, is a lossless proposal whatever prefix it was
   drafted after.)
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import cluster.routing.predrafting
from cluster.local import LocalTandem
from cluster.routing.generation import Draft
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import PreDraft
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from tests.cluster.routing.test_predraft_sampling import (
    ALPHA,
    MIN_EXPECTED,
    exact_cells,
    predrafting_router,
    sample_first_tokens,
)
from tests.cluster.routing.test_predraft_seed_exact_sampling import SEED_EXACT, seeded_run
from tests.exact_cells import chi_square_p_value

_right_hit = cluster.routing.predrafting.hit


def _first_branch(predrafts: Sequence[PreDraft], verdict: Verdict, max_tokens: int) -> Draft | None:
    """A wrong cache: the first branch, whatever outcome the verdict names."""
    if not predrafts or not verdict.tokens or verdict.dropped:
        return None
    first = predrafts[0]
    probs = None if first.draft_probs is None else tuple(first.draft_probs[:max_tokens])
    block = DraftBlock(verdict.committed_length, first.tokens[:max_tokens], draft_probs=probs)
    return Draft(block, by_drafter=False)


def _another_branchs_q(
    predrafts: Sequence[PreDraft], verdict: Verdict, max_tokens: int
) -> Draft | None:
    """A wrong cache: the right branch's tokens, with the q's of the branch after it."""
    draft = _right_hit(predrafts, verdict, max_tokens)
    if draft is None or len(predrafts) < 2:
        return draft
    accepted = verdict.num_matched + verdict.num_accepted
    block, outcome = draft.block, (accepted, verdict.tokens[-1])
    index = next(i for i, b in enumerate(predrafts) if (b.accepted, b.token) == outcome)
    other = predrafts[(index + 1) % len(predrafts)].draft_probs
    assert other is not None
    wrong = DraftBlock(block.base_length, block.tokens, tuple(other[: len(block.tokens)]))
    return Draft(wrong, by_drafter=False)


@pytest.mark.parametrize("sampling", [SamplingParams(), SEED_EXACT], ids=["greedy", "seed-exact"])
def test_a_wrong_hit_changes_acceptance_never_the_output(
    local_tandem: LocalTandem, sampling: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    right = seeded_run(local_tandem, 4, sampling, 3)
    monkeypatch.setattr(cluster.routing.predrafting, "hit", _first_branch)
    wrong = seeded_run(local_tandem, 4, sampling, 3)
    # The verifier's equality check keeps the output the target's: equality cannot see it.
    assert [r.tokens for r in wrong] == [r.tokens for r in right]
    # Acceptance does: a block drafted after another outcome's prefix is mostly rejected.
    assert sum(r.stats.predraft_hits for r in wrong) > 0
    accepted = [sum(r.stats.num_accepted for r in run) for run in (right, wrong)]
    rounds = [sum(r.stats.num_verify_passes for r in run) for run in (right, wrong)]
    assert accepted[1] < 0.8 * accepted[0] and rounds[1] > rounds[0]


@pytest.mark.slow
def test_a_cache_that_reports_the_wrong_q_fails_the_statistic(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Untruncated q's: every token has some probability under the other branch's q, so the
    # verifier takes the lie rather than refusing the block.
    drafter = Drafter(tiny_draft, DrafterConfig(top_k=0))
    router = predrafting_router(local_tandem, drafter, 4)
    monkeypatch.setattr(cluster.routing.predrafting, "hit", _another_branchs_q)
    try:
        samples, tally = sample_first_tokens(router, draft_tokens=1, max_tokens=4)
    finally:
        router.close()
        drafter.close()
    assert tally.hits > 0
    cells = exact_cells(tiny_target, local_tandem.router._eos_token_ids)
    assert chi_square_p_value(samples, cells, MIN_EXPECTED) < ALPHA
