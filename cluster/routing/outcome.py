"""What a verdict on a posted block tells the request's counters and its plan.

Pure bookkeeping over `Generation` and `SpeculationStats`, no I/O: the router calls `record`
once for every verdict on a block it posted (never for the steps the verifier took alone).
A block's accepted tokens are the ones its session had already committed, the same (matched),
and the verified ones after them. A dropped block (it came too late, or parted from the
session) counts as drafted with none accepted, so that a request's counts show every block
it sent; only verified blocks enter the per-position counts (`record_block`) and the plan. A
block drafted ahead of one not accepted whole is a pipeline miss, one verified after it a hit;
one the router itself found stale is a miss too, counted where it drops it.
"""

from __future__ import annotations

from cluster.routing.generation import Generation, Posted
from cluster.runtime.draft_block import Verdict


def record(gen: Generation, posted: Posted, verdict: Verdict) -> None:
    """Count `verdict` on `posted` in the request's counters, and in its plan's acceptance
    (model and lookup blocks) or its suffix drafter's record (suffix blocks)."""
    block, stats = posted.block, gen.stats
    drafted = len(block.tokens)
    accepted = 0 if verdict.dropped else verdict.num_matched + verdict.num_accepted
    stats.num_drafted += drafted
    stats.num_accepted += accepted
    if not verdict.dropped:
        stats.record_block(drafted, accepted)
    if posted.draft.ahead:
        if verdict.dropped:
            stats.pipeline_misses += 1
        else:
            stats.pipeline_hits += 1
    if posted.draft.by_suffix:  # priced apart: the model's acceptance is the plan's
        gen.suffix.use.verified(accepted, drafted)
        stats.suffix_drafted += drafted
        stats.suffix_accepted += accepted
    else:
        if posted.draft.by_drafter:
            stats.model_drafted += drafted
            stats.model_accepted += accepted
        if not verdict.dropped and drafted > 0:
            gen.lengths.observe(drafted, accepted)
