"""What a round's verdict changes besides the committed history: the drafter's view of the
session, the draft to verify next, and the request's speculation counters.

Pure bookkeeping over `Generation` and `SpeculationStats`, no I/O: the router calls both once
per verify pass, after committing the verdict's tokens.
"""

from __future__ import annotations

from cluster.routing.generation import Draft, DrafterView, Generation
from cluster.routing.request import SpeculationStats
from cluster.runtime.draft_block import DraftBlock, Verdict


def after_verdict(
    gen: Generation, block: DraftBlock, verdict: Verdict, next_draft: Draft | None
) -> Draft | None:
    """Update the drafter's view; return the draft to verify next, if one is ready (a block
    drafted ahead whose bet, all of `block` accepted, came true)."""
    hit = next_draft is not None and verdict.bonus_deferred
    if next_draft is None or not next_draft.by_drafter:
        gen.drafter.behind.extend(verdict.tokens)
        return next_draft if hit else None
    next_base = next_draft.block.base_length
    if hit:
        gen.drafter = DrafterView(base_length=next_base)
        return next_draft
    # The drafter assumed all of `block`: keep what was accepted, then the correction.
    gen.drafter = DrafterView(
        base_length=next_base,
        truncate_to=block.base_length + verdict.num_accepted,
        behind=list(verdict.tokens[verdict.num_accepted :]),
    )
    return None


def count_round(
    stats: SpeculationStats, block: DraftBlock, verdict: Verdict, next_draft: Draft | None
) -> None:
    """Add one verify pass of `block` to the request's counters (a draft ahead: a pipeline
    hit or miss)."""
    stats.num_verify_passes += 1
    stats.num_drafted += len(block.tokens)
    stats.num_accepted += verdict.num_accepted
    stats.record_block(len(block.tokens), verdict.num_accepted)
    if next_draft is not None:
        if verdict.bonus_deferred:
            stats.pipeline_hits += 1
        else:
            stats.pipeline_misses += 1
