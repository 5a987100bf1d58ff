"""Outcome-keyed pre-drafting, the router's part: which branches to ask the drafter for while a
block is verified, and which of them the verdict hits.

Pure, no I/O. The drafter names each branch's token itself (the draft's choice of a rank after
the outcome's prefix, `drafter.branches`), so the router chooses (accept length, rank) pairs by
their odds (`cluster.routing.predraft_budget.branch_odds`: the accept length's at the request's
measured acceptance, times a prior over ranks; after a rejection the draft's own token is
skipped, so rank 0 is its best other choice); each is a `Branch`. How many (the fan-out) is the
adaptive plan's choice. A verdict hits the branch whose accept length and token it commits;
that branch's block is verified next at once, as a looked-up block is: the drafter's session
never saw it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.routing.generation import Draft, Generation
from cluster.routing.predraft_budget import branch_odds
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.predraft import Branch, PreDraft


@dataclass(frozen=True)
class Branches:
    """A pre-draft's answer: the branches drafted, and the odds that the verdict hits one."""

    drafted: Sequence[PreDraft]
    odds: float


def choose_branches(alpha: float, k: int, fan_out: int) -> list[Branch]:
    """The `fan_out` likeliest (accepted, rank) outcomes of verifying a k-token block at
    per-position acceptance `alpha`, likeliest first (`predraft_budget.branch_odds`)."""
    return [
        Branch(accepted, rank) for _, accepted, rank in branch_odds(alpha, k)[: max(0, fan_out)]
    ]


def hit(predrafts: Sequence[PreDraft], verdict: Verdict, max_tokens: int) -> Draft | None:
    """The branch `verdict` hits, as the draft to verify next (based where the verdict left
    its session, and at most `max_tokens` long); None on a miss."""
    if not verdict.tokens or verdict.dropped:
        return None
    token, accepted = verdict.tokens[-1], verdict.num_matched + verdict.num_accepted
    for branch in predrafts:
        if branch.accepted == accepted and branch.token == token:
            probs = branch.draft_probs
            block = DraftBlock(
                base_length=verdict.committed_length,
                tokens=branch.tokens[:max_tokens],
                draft_probs=None if probs is None else probs[:max_tokens],
            )
            return Draft(block, by_drafter=False)
    return None


def predrafted(gen: Generation, verdict: Verdict, branches: Branches) -> Draft | None:
    """A pre-drafted round's bookkeeping, once both its verdict and its branches are in: the
    counters (a hit or a miss of the blocks drafted ahead) and the draft to verify next, if
    the verdict hit a branch."""
    # A branch was drafted as long as the block it follows allowed: cut it to what is left
    # after the verdict, less the target's own token after it.
    left = gen.request.max_tokens - (verdict.committed_length - gen.prompt_length)
    draft = hit(branches.drafted, verdict, max(0, left - 1))
    if branches.drafted:
        gen.lengths.observe_predraft_outcome(draft is not None, branches.odds)
    if draft is None:
        gen.stats.predraft_misses += 1
    else:
        gen.stats.predraft_hits += 1
    return draft
