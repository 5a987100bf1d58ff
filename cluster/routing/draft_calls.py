"""Where a round's blocks come from: the router's calls for drafts.

A block to verify now (`DraftCalls.now`): the suffix drafter's, if asked and long enough, else
prompt lookup's, else the draft model's. A block ahead (`DraftCalls.ahead`): the next block as
if all of the current one were accepted, looked up at once or drafted beside the verify pass.
Pre-drafted blocks (`DraftCalls.predraft`): the next block after each of the likeliest outcomes
of the verify pass (`cluster.routing.predrafting`). Each times what the drafter took for the
request's adaptive plan and the metrics, and fails over a drafter that failed
(`cluster.routing.failover`). The loop that decides which to ask for is the router's
(`cluster.routing.router`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cluster.metrics import TandemMetrics
from cluster.routing.failover import DRAFTER_FAILED, Failover
from cluster.routing.generation import Draft, DrafterView, Generation
from cluster.routing.ports import DrafterPort, begin_call, draft_steps
from cluster.routing.predraft_budget import hit_odds
from cluster.routing.predrafting import Branches, choose_branches
from cluster.routing.waits import Started, Steps, done_steps
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_BLOCK_TOKENS
from cluster.runtime.predraft import PreDraft


class DraftCalls:
    """A router's draft calls: sent on `pool`'s threads where a port blocks, failed over by
    `failover`, timed into `metrics()` (read at each call: a router's metrics may be replaced)."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        failover: Failover,
        metrics: Callable[[], TandemMetrics],
    ) -> None:
        self._pool = pool
        self._failover = failover
        self._metrics = metrics

    def now(
        self, gen: Generation, num_tokens: int, by_drafter: bool = True, suffix: bool = False
    ) -> Steps[Draft]:
        """A block to verify now: proposed by the suffix drafter (if `suffix`: up to
        MAX_BLOCK_TOKENS, at least `num_tokens`), else up to `num_tokens` looked up, else
        drafted (if `by_drafter`), else empty."""
        if suffix:
            # Its index holds the request's own prompt too, so it finds what prompt lookup
            # finds, and more; its blocks may be longer than the model's (it ends them where
            # their confidence falls); one shorter than the model's is left to lookup or the
            # model. Where it earns nothing, it is asked less and less often (SuffixUse).
            longest = min(MAX_BLOCK_TOKENS, gen.remaining - 1)
            proposed = yield from gen.suffix.propose(
                self._pool, gen.request, gen.history, longest, shortest=max(1, num_tokens)
            )
            if proposed is not None:
                return Draft(proposed, by_drafter=False, by_suffix=True)
        looked_up = gen.look_up(num_tokens) if num_tokens > 0 else None
        if num_tokens <= 0:
            return Draft(DraftBlock(base_length=gen.committed, tokens=()), by_drafter=False)
        if looked_up is not None or gen.drafter_port is None or not by_drafter:
            empty = DraftBlock(base_length=gen.committed, tokens=())
            return Draft(looked_up or empty, by_drafter=False)
        view = gen.drafter
        try:
            port = yield from gen.ready_drafter()
            started = time.perf_counter()
            block = yield from draft_steps(
                port, gen.session_id, view.base_length, view.behind, num_tokens, view.truncate_to
            )
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return (yield from self.now(gen, num_tokens, by_drafter))
        draft_s = time.perf_counter() - started
        gen.lengths.observe_draft(len(block.tokens), draft_s, load=block.load)
        self._metrics().drafted(draft_s)
        gen.drafter = DrafterView(base_length=block.base_length)
        return Draft(block, by_drafter=True)

    def predraft(
        self, gen: Generation, block: DraftBlock, num_tokens: int, fan_out: int
    ) -> Steps[Started | None]:
        """Ask the drafter for the next block after each of the `fan_out` likeliest outcomes
        of verifying `block` (`cluster.routing.predrafting`), sent now and finished after the
        verdict; None where the request or its drafter does not pre-draft."""
        if fan_out <= 0 or gen.drafter_port is None or gen.lengths.max_fan_out <= 0:
            return None
        port = yield from self._ready_drafter_ahead(gen)
        if port is None:
            return None
        view = gen.drafter
        alpha, k = gen.lengths.acceptance, len(block.tokens)
        branches = choose_branches(alpha, k, fan_out)
        args = (gen.session_id, view.base_length, view.behind, block.tokens, branches, num_tokens)
        sent_at = time.perf_counter()
        drafting = begin_call(self._pool, port, "predraft", *args, truncate_to=view.truncate_to)
        keep = view.base_length if view.truncate_to is None else view.truncate_to
        gen.drafter = DrafterView(base_length=keep + len(view.behind))  # committed, no more
        return Started(self._predrafted(gen, drafting, sent_at, alpha, k, num_tokens, view))

    def _ready_drafter_ahead(self, gen: Generation) -> Steps[DrafterPort | None]:
        """The request's drafter, once its session is open, for drafting ahead; None (the
        round goes on without) if it failed, after failing over."""
        try:
            return (yield from gen.ready_drafter())
        except DRAFTER_FAILED as error:
            self._failover.replace(gen, "drafter", error)
            return None

    def _predrafted(
        self, gen: Generation, drafting: Started, sent_at: float, alpha: float, k: int,
        num_tokens: int, view: DrafterView,
    ) -> Steps[Branches]:  # fmt: skip
        try:
            drafted: list[PreDraft] = yield from drafting.finish()
        except InvalidArgumentError:
            # A drafter that refuses the call (a replica from before pre-drafting, or a
            # pre-draft past its limits) took none of it: its view is as before the call, and
            # the request stops asking. The round is a miss; output is unchanged.
            gen.drafter = view
            gen.lengths.max_fan_out = 0
            return Branches((), 0.0)
        elapsed = (drafting.finished_at or time.perf_counter()) - sent_at
        self._metrics().drafted(elapsed)
        load = next((branch.load for branch in drafted if branch.load is not None), None)
        gen.lengths.observe_predraft(elapsed, len(drafted), num_tokens, load)
        return Branches(drafted, hit_odds(alpha, k, len(drafted)))

    def ahead(self, gen: Generation, block: DraftBlock, num_tokens: int) -> Steps[Started | None]:
        """Propose the block after `block` as if all of it were accepted: looked up at once,
        or drafted in the background (sent now, finished after the verdict); None if neither
        can."""
        looked_up = gen.look_up(num_tokens, ahead=block.tokens)
        if looked_up is not None:
            return Started(done_steps(Draft(looked_up, by_drafter=False)))
        if gen.drafter_port is None:
            return None
        port = yield from self._ready_drafter_ahead(gen)
        if port is None:
            return None
        # The drafter catches up on what its view lacks, then on `block` itself (a no-op
        # suffix when `block` came from it: its view then lacks nothing).
        view = gen.drafter
        appended = view.behind + list(block.tokens)
        args = (gen.session_id, view.base_length, appended, num_tokens, view.truncate_to)
        sent_at = time.perf_counter()
        # Over frames it leaves with the next frame and nothing waits for it until the verdict;
        # a port whose calls block drafts on a thread of the router's pool, beside the verify.
        drafting = begin_call(self._pool, port, "draft", *args)
        return Started(self._drafted_ahead(gen, drafting, sent_at))

    def _drafted_ahead(self, gen: Generation, drafting: Started, sent_at: float) -> Steps[Draft]:
        next_block: DraftBlock = yield from drafting.finish()
        # Timed to its answer, not to when the loop reads it (after the verdict).
        elapsed = (drafting.finished_at or time.perf_counter()) - sent_at
        gen.lengths.observe_draft(
            len(next_block.tokens), elapsed, overlapped=True, load=next_block.load
        )
        self._metrics().drafted(elapsed)
        return Draft(next_block, by_drafter=True)
