"""Outcome-keyed pre-drafting, the router's part: which branches to ask the drafter for while a
block is verified, and which of them the verdict hits.

Pure, no I/O. The drafter names each branch's token itself (the draft's choice of a rank after
the outcome's prefix, `drafter.branches`), so the router chooses (accept length, rank) pairs
with the odds of `cluster.runtime.predraft`: the accept length's at the request's measured
acceptance, times a prior over ranks (`RANK_PRIOR`; after a rejection the draft's own token is
skipped, so rank 0 is its best other choice); each is a `Branch`. A verdict hits the branch
whose accept length and token it commits; that branch's block is verified next at once, as a
looked-up block is: the drafter's session never saw it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.routing.generation import Draft, Generation
from cluster.routing.outcome import count_round
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.predraft import Branch, PreDraft, accept_odds

RANK_PRIOR = (0.6, 0.2, 0.1)
"""P(the committed token is the draft's choice of rank r): after a rejection, among the draft's
tokens other than the one rejected; after a whole block, the share the draft's favourite misses
is spread the same way."""


def choose_branches(alpha: float, k: int, fan_out: int) -> list[Branch]:
    """The `fan_out` likeliest (accepted, rank) outcomes of verifying a k-token block at
    per-position acceptance `alpha`, likeliest first."""
    scored: list[tuple[float, int, int]] = []
    for accepted, p in enumerate(accept_odds(alpha, k)):
        ranks = RANK_PRIOR if accepted < k else (alpha, *((1 - alpha) * r for r in RANK_PRIOR))
        scored.extend((p * r, accepted, rank) for rank, r in enumerate(ranks))
    scored.sort(key=lambda s: (-s[0], s[1], s[2]))
    return [Branch(accepted, rank) for _, accepted, rank in scored[: max(0, fan_out)]]


def hit(
    predrafts: Sequence[PreDraft], verdict: Verdict, committed: int, max_tokens: int
) -> Draft | None:
    """The branch `verdict` hits, as the draft to verify next (based at `committed`, the length
    after the verdict, and at most `max_tokens` long); None on a miss."""
    if not verdict.tokens:
        return None
    token = verdict.tokens[-1]
    for branch in predrafts:
        if branch.accepted == verdict.num_accepted and branch.token == token:
            block = DraftBlock(base_length=committed, tokens=branch.tokens[:max_tokens])
            return Draft(block, by_drafter=False)
    return None


def predrafted(
    gen: Generation, block: DraftBlock, verdict: Verdict, branches: Sequence[PreDraft] | None
) -> Draft | None:
    """A pre-drafted round's bookkeeping, after its verdict is committed: the counters (a hit
    or a miss of the blocks drafted ahead), the drafter's view (it holds the committed tokens
    up to the block, and now lacks the verdict's) and the draft to verify next, if the verdict
    hit a branch. `branches`: None if the drafter failed meanwhile."""
    count_round(gen.stats, block, verdict, None)
    gen.drafter.behind.extend(verdict.tokens)
    if branches is None:
        return None
    # A branch was drafted as long as the block it follows allowed: cut it to what is left
    # (the verdict is not emitted yet), less the target's own token after it.
    left = gen.remaining - len(verdict.tokens)
    draft = hit(branches, verdict, gen.committed, max(0, left - 1))
    if draft is None:
        gen.stats.predraft_misses += 1
    else:
        gen.stats.predraft_hits += 1
    return draft
