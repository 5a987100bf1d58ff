"""Where a round's blocks come from: the router's calls for drafts.

A block now (`DraftCalls.now`): the suffix drafter's, if asked and long enough, else prompt
lookup's, else the draft model's. A block ahead (`DraftCalls.ahead`): the block after a posted
one, as if all of it were accepted, looked up or drafted while that one is verified.
Pre-drafted blocks (`DraftCalls.predraft`): the next block after each of the likeliest outcomes
of the verify pass (`cluster.routing.predrafting`). Each is waits (`cluster.routing.waits`)
the router's loop runs beside its reading of the verifier's reports; each times what the
drafter took for the request's adaptive plan and the metrics, and fails over a drafter that
failed (`cluster.routing.failover`). The drafter's session is brought to what it must hold by
the request's link to it (`DrafterLink.call`). The loop that decides which to ask for is the
router's (`cluster.routing.rounds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.metrics.recorder import TandemMetrics
from cluster.routing.failover import DRAFTER_FAILED, Failover
from cluster.routing.generation import Draft, Generation
from cluster.routing.ports import DrafterPort
from cluster.routing.predraft_budget import hit_odds
from cluster.routing.predrafting import Branches, choose_branches
from cluster.routing.waits import Waits
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_BLOCK_TOKENS
from cluster.runtime.predraft import PreDraft


class DraftCalls:
    """A router's draft calls: failed over by `failover`, timed into `metrics()` (read at each
    call: a router's metrics may be replaced)."""

    def __init__(self, failover: Failover, metrics: Callable[[], TandemMetrics]) -> None:
        self._failover = failover
        self._metrics = metrics

    def now(
        self,
        gen: Generation,
        num_tokens: int,
        by_drafter: bool = True,
        suffix: bool = False,
        suffix_longest: int = MAX_BLOCK_TOKENS,
    ) -> Waits[Draft]:
        """A block to verify now: proposed by the suffix drafter (if `suffix`: up to
        `suffix_longest`, at least `num_tokens`), else up to `num_tokens` looked up, else
        drafted (if `by_drafter`), else empty."""
        if suffix:
            # Its index holds the request's own prompt too, so it finds what prompt lookup
            # finds, and more; its blocks may be longer than the model's (it ends them where
            # their confidence falls); one shorter than the model's is left to lookup or the
            # model. Where it earns nothing, it is asked less and less often (SuffixUse).
            longest = min(suffix_longest, MAX_BLOCK_TOKENS, gen.remaining - 1)
            proposed = yield from gen.suffix.propose(
                gen.request, gen.history, longest, shortest=max(1, min(num_tokens, longest))
            )
            if proposed is not None:
                return Draft(proposed, by_drafter=False, by_suffix=True)
        if num_tokens <= 0:
            return Draft(DraftBlock(base_length=gen.committed, tokens=()), by_drafter=False)
        looked_up = gen.look_up(num_tokens)
        if looked_up is not None or gen.drafter.port is None or not by_drafter:
            empty = DraftBlock(base_length=gen.committed, tokens=())
            return Draft(looked_up or empty, by_drafter=False)
        try:
            port = yield from gen.drafter.ready()
            base, truncate_to, appended = gen.drafter.call(gen.history)
            started = time.perf_counter()
            block = yield from port.draft(gen.session_id, base, appended, num_tokens, truncate_to)
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return (yield from self.now(gen, num_tokens, by_drafter))
        draft_s = time.perf_counter() - started
        gen.lengths.observe_draft(len(block.tokens), draft_s, load=block.load)
        self._metrics().drafted(draft_s)
        return Draft(block, by_drafter=True)

    def ahead(self, gen: Generation, block: DraftBlock, num_tokens: int) -> Waits[Draft | None]:
        """The block after `block` (as posted, based where the history ends: its assumed and
        own tokens are not committed yet) as if all of it were accepted: looked up, else
        drafted while `block` is verified; None if neither can. The drafted block assumes
        `block`."""
        assert block.base_length == gen.committed, "drafted ahead of a block rebased first"
        after = (*block.assumed, *block.tokens)
        looked_up = gen.look_up(num_tokens, ahead=after)
        if looked_up is not None:
            return Draft(_assuming(looked_up, block), by_drafter=False, ahead=True)
        if gen.drafter.port is None:
            return None
        port = yield from self._ready_drafter_ahead(gen)
        if port is None or gen.committed != block.base_length:
            return None  # no drafter, or its session opened after the history moved on
        base, truncate_to, appended = gen.drafter.call(gen.history, after)
        sent_at = time.perf_counter()
        try:
            drafted = yield from port.draft(gen.session_id, base, appended, num_tokens, truncate_to)
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return None
        elapsed = time.perf_counter() - sent_at
        gen.lengths.observe_draft(len(drafted.tokens), elapsed, overlapped=True, load=drafted.load)
        self._metrics().drafted(elapsed)
        return Draft(_assuming(drafted, block), by_drafter=True, ahead=True)

    def predraft(
        self, gen: Generation, block: DraftBlock, num_tokens: int, fan_out: int
    ) -> Waits[Branches | None] | None:
        """Ask the drafter for the next block after each of the `fan_out` likeliest outcomes
        of verifying `block` (`cluster.routing.predrafting`; `block` has no assumed tokens);
        None where the request or its drafter does not pre-draft. The steps return None when
        the drafter was lost meanwhile (it drafted nothing to hit: neither a hit nor a miss)."""
        if fan_out <= 0 or gen.drafter.port is None or gen.lengths.max_fan_out <= 0:
            return None
        return self._predrafted(gen, block, num_tokens, fan_out)

    def _predrafted(
        self, gen: Generation, block: DraftBlock, num_tokens: int, fan_out: int
    ) -> Waits[Branches | None]:
        port = yield from self._ready_drafter_ahead(gen)
        predraft = getattr(port, "predraft", None)
        if predraft is None or gen.committed != block.base_length:
            return Branches((), 0.0)
        alpha, k = gen.lengths.acceptance, len(block.tokens)
        branches = choose_branches(alpha, k, fan_out)
        held = gen.drafter.held()
        base, truncate_to, appended = gen.drafter.call(gen.history)
        sent_at = time.perf_counter()
        try:
            drafted: list[PreDraft] = yield from predraft(
                gen.session_id, base, appended, block.tokens, branches, num_tokens, truncate_to
            )
        except InvalidArgumentError:
            # A drafter that refuses the call (a replica from before pre-drafting, or a
            # pre-draft past its limits) took none of it: its view is as before the call,
            # and the request stops asking. Output is unchanged.
            gen.drafter.refused(held)
            gen.lengths.max_fan_out = 0
            return Branches((), 0.0)
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return None
        elapsed = time.perf_counter() - sent_at
        self._metrics().drafted(elapsed)
        load = next((branch.load for branch in drafted if branch.load is not None), None)
        gen.lengths.observe_predraft(elapsed, len(drafted), num_tokens, load)
        return Branches(drafted, hit_odds(alpha, k, len(drafted)))

    def _ready_drafter_ahead(self, gen: Generation) -> Waits[DrafterPort | None]:
        """The request's drafter, once its session is open, for drafting ahead; None (the
        round goes on without) if it failed, after failing over."""
        try:
            return (yield from gen.drafter.ready())
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return None


def _assuming(drafted: DraftBlock, block: DraftBlock) -> DraftBlock:
    """`drafted`, the block after `block`, based where `block` is, assuming all of it."""
    return DraftBlock(
        base_length=block.base_length,
        tokens=drafted.tokens,
        draft_probs=drafted.draft_probs,
        load=drafted.load,
        assumed=(*block.assumed, *block.tokens),
    )
