"""One request's loop in the router: its rounds, each plan, draft, verify, commit, emit.

The verifier drives each session (docs/architecture.md, "The verifier drives each session"):
a running session is in every verifier step, taking the target's own next token whenever no
block of the router's is there, and reports each step (`SessionEvents`). So the router is
never between two of the device's steps. Its loop, `Rounds.run`, takes each part of a round as
soon as there is something to do, waiting on whichever comes first (`_wait`):

1. **Plan and draft** (`_draft`): while the speculation gate and the request's adaptive plan
   say speculation pays (`_plan`) and nothing is posted, ask for a block now (the suffix
   drafter, prompt lookup, the draft model: `cluster.routing.draft_calls`); once a block is
   posted and the plan pipelines, draft the block after it as if it were all accepted
   (`_chain`), or pre-draft branches for its likely outcomes.
2. **Verify** (`_post`, as soon as a block is drafted: `_post_drafted`, `_post_branch`): the
   block goes to the verifier based where the history now ends (`rebase`: tokens committed
   meanwhile that it drafted right are left out; one the history parted from is never sent).
   A block drafted ahead is sent before the verdict on the one it follows, assuming that
   one's tokens; the verifier verifies it from where its session then stands, or drops it.
3. **Commit** (`_commit`) the session's reports: their tokens to the history (the request's
   one record), a posted block's verdict counted (`cluster.routing.outcome`), the verifier
   failed over on an error (`Failover.move_verifier`) or a silence (`cluster.routing.silence`).
4. **Emit** (`cluster.routing.output.emit`): everything committed at once leaves as one chunk
   (end tokens, stop strings, `max_tokens`), so a stream carries at most one chunk per
   verifier step.

With `Generation.advance` None (the router option `verifier_advances` off, or a request whose
draft model shares the verifier's cores: `cluster.routing.generation.runs_in_lockstep`),
sessions do not run: every round posts one block, an empty one when there is nothing to
speculate (the target alone), and waits for its verdict, as a lockstep loop does; the first
round then waits for the drafter too.

Timing for the adaptive plan: a verify pass is the time between two reports of the session
(about one verifier step), a draft the call's own time. Pure orchestration: it yields its waits
(`cluster.routing.waits`), so one driver runs any number of requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from cluster.metrics.recorder import TandemMetrics
from cluster.routing.draft_calls import DraftCalls
from cluster.routing.draft_modes import ALONE, LOOKUP, MODEL
from cluster.routing.failover import Failover
from cluster.routing.generation import Draft, Generation, Posted
from cluster.routing.goodput import Plan
from cluster.routing.outcome import record
from cluster.routing.output import emit
from cluster.routing.predrafting import Branches, predrafted
from cluster.routing.request import GenerationChunk
from cluster.routing.silence import check_silence, heard_by
from cluster.routing.speculation_gate import SpeculationGate
from cluster.routing.waits import Pending, Wait, Waits, first_done
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.runtime.limits import MAX_BLOCK_TOKENS
from cluster.runtime.rebase import rebase

NO_PLAN = Plan(0, False)


class Rounds:
    """The loop of every request of one router (see the module docstring)."""

    def __init__(
        self,
        gate: SpeculationGate,
        predraft_gate: SpeculationGate,
        drafts: DraftCalls,
        failover: Failover,
        metrics: Callable[[], TandemMetrics],
        eos_token_ids: frozenset[int],
    ) -> None:
        self.gate = gate
        self.predraft_gate = predraft_gate
        self._drafts = drafts
        self._failover = failover
        self._metrics = metrics
        self._eos_token_ids = eos_token_ids
        self.recent: Generation | None = None
        """The request that last timed a verify pass: where a new one's plan starts."""

    def run(self, gen: Generation) -> Iterator[GenerationChunk | Wait]:
        """The request's chunks as the verifier commits its tokens, with a `Wait` wherever it
        waits; ends after the chunk with the finish reason. Each turn takes what is there to
        take of a round (see the module docstring)."""
        try:
            while True:
                gen.check_deadline()
                self._draft(gen)  # plan; ask for the block the plan asks for (posted if in)
                yield from self._wait(gen)  # the session's next report, or a draft's answer
                self._post_drafted(gen)  # verify: a block drafted meanwhile goes out
                tokens = yield from self._commit(gen)  # the session's reports, into history
                self._post_branch(gen)  # the verdict just read may be the one it waits for
                if not tokens:
                    continue
                chunk = emit(gen, tokens, self._eos_token_ids)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            for pending in (gen.drafting, gen.predrafted):
                if pending is not None:
                    pending.close()
            gen.drafting = gen.predrafted = None

    # ------------------------------------------------------------------ planning and drafting

    def _draft(self, gen: Generation) -> None:
        """Plan the round (`_plan`) and start what the plan asks for: while nothing is posted,
        a block now (posted at once when looked up), or in lockstep an empty block for the
        target's own token; while one block is posted, the block after it (`_chain`)."""
        if gen.drafting is not None or gen.predrafted is not None:
            return  # one call at a time; pre-drafted branches may be the next block
        if gen.posts:
            self._chain(gen)
            return
        plan = self._plan(gen)
        k = min(plan.k, gen.remaining - 1)
        speculating = plan is not NO_PLAN
        gen.round_mode = gen.modes.mode if speculating else ALONE
        if k <= 0 and not speculating:
            if gen.advance is None:  # lockstep: the target's own token, through a block
                self._post(gen, Draft(DraftBlock(gen.committed, ()), by_drafter=False))
            return
        gen.plan = plan
        by_drafter = k > 0 and gen.round_mode == MODEL
        # The measured verify passes price the suffix drafter's blocks, cut to the length
        # that pays at its acceptance (on a CPU without native bf16, a pass of k + 1 tokens
        # costs about k + 1 steps: a long block is a loss unless accepted nearly whole).
        longest = MAX_BLOCK_TOKENS
        if speculating and gen.suffix.port is not None:
            longest = gen.lengths.paying_length(gen.suffix.use.acceptance, longest)
            longest += gen.advance is not None  # a running session's next step takes one
        drafting = self._drafts.now(
            gen, max(k, 0), by_drafter=by_drafter, suffix=speculating, suffix_longest=longest
        )
        gen.drafting = Pending(drafting, gen.now)
        self._post_drafted(gen)

    def _plan(self, gen: Generation) -> Plan:
        """This round's plan: NO_PLAN (no speculation at all) where the request asks for none
        or the gate holds the target alone; else the adaptive plan's."""
        if gen.request.draft_tokens <= 0 or not self.gate.speculate():
            return NO_PLAN
        if gen.modes.mode == ALONE:
            return NO_PLAN  # measured: this request commits more with the target alone
        if gen.modes.mode == LOOKUP:  # measured: the draft model does not pay
            plan = gen.lengths.lookup_plan()
            # A block reaches a running session after its step in flight, which commits the
            # block's first token by itself: one more token, or the block is stale on arrival.
            running = gen.advance is not None and plan.k > 0
            return Plan(min(plan.k + 1, gen.lengths.max_k), False) if running else plan
        plan = gen.lengths.next_plan()
        if plan.fan_out > 0 and not self.predraft_gate.speculate():
            plan = Plan(plan.k, plan.pipelined)  # measured faster without pre-drafting
        return plan

    def _chain(self, gen: Generation) -> None:
        """Draft the block after the one posted last, as if all of it were accepted, where the
        plan pipelines, that block is still a draft of what comes next and it is the only one
        posted (a block in flight and one ahead of it)."""
        if len(gen.posts) != 1 or not gen.plan.pipelined or gen.drafting is not None:
            return
        posted = next(iter(gen.posts.values()))
        if posted.draft.by_suffix or not posted.block.tokens:
            return
        block = posted.block
        if block.base_length < gen.committed:
            rebased = rebase(block, gen.history[block.base_length :])
            if rebased is None or not rebased.tokens:
                return
            matched = len(block.tokens) - len(rebased.tokens)  # the history's own already
            gen.stats.num_drafted += matched
            gen.stats.num_accepted += matched
            block = rebased
        ahead_k = self._ahead_k(gen, block)
        if ahead_k <= 0:
            return
        gen.drafting = Pending(self._drafts.ahead(gen, block, ahead_k), gen.now)
        self._post_drafted(gen)

    def _ahead_k(self, gen: Generation, block: DraftBlock) -> int:
        """The length of a block drafted after `block`: the plan's, leaving room for the
        target's own token after it within `max_tokens`."""
        return min(gen.plan.k, gen.remaining - len(block.assumed) - len(block.tokens) - 1)

    # ------------------------------------------------------------------ verifying

    def _post_drafted(self, gen: Generation) -> None:
        """Post a draft that has come in; match pre-drafted branches to their verdict."""
        pending = gen.drafting
        if pending is not None and pending.poll():
            gen.drafting = None
            draft: Draft | None = pending.result()
            if draft is not None:
                self._post(gen, draft)
        self._post_branch(gen)

    def _post_branch(self, gen: Generation) -> None:
        """Once both the branches and the verdict on the block they follow are in, post the
        branch the verdict hit, if any."""
        pending = gen.predrafted
        if pending is None:
            return
        if gen.predraft_verdict is None and gen.predraft_for not in gen.posts:
            pending.close()  # its block was lost with its verifier: no verdict will come
            self._drop_branches(gen)
            return
        if not pending.poll() or gen.predraft_verdict is None:
            return
        branches: Branches | None = pending.result()
        verdict = gen.predraft_verdict
        self._drop_branches(gen)
        if branches is None:
            return  # its drafter was lost: no branch to hit, and no miss to count
        draft = predrafted(gen, verdict, branches)
        if draft is not None:
            self._post(gen, draft)

    def _drop_branches(self, gen: Generation) -> None:
        gen.predrafted, gen.predraft_for, gen.predraft_verdict = None, None, None

    def _post(self, gen: Generation, draft: Draft) -> None:
        """Send `draft`'s block, based where the history ends (not at all if it parted from
        it, or holds nothing left to verify while the session runs), and start drafting the
        block after it where the plan pipelines."""
        block = draft.block
        if block.base_length < gen.committed:
            rebased = rebase(block, gen.history[block.base_length :])
            if rebased is None:  # stale: counted as drafted, none accepted, never verified
                gen.stats.num_drafted += len(block.tokens)
                if draft.by_drafter:
                    gen.stats.model_drafted += len(block.tokens)
                if draft.by_suffix:
                    gen.stats.suffix_drafted += len(block.tokens)
                if draft.ahead:
                    gen.stats.pipeline_misses += 1
                return
            matched = len(block.tokens) - len(rebased.tokens)  # the history's own already
            gen.stats.num_drafted += matched
            gen.stats.num_accepted += matched
            block = rebased
        if not block.tokens and gen.advance is not None:
            return  # the session takes the target's own tokens by itself
        plan = gen.plan
        ahead_k = self._ahead_k(gen, block)
        chained = plan.pipelined and bool(block.tokens) and not draft.by_suffix and ahead_k > 0
        predraft = chained and plan.fan_out > 0 and not block.assumed
        deferred = chained and not predraft and gen.drafter.port is not None
        post_id = gen.next_post_id()
        gen.posts[post_id] = Posted(block, draft, time.perf_counter(), deferred)
        gen.verifier.post(gen.session_id, block, deferred, gen.events, post_id)
        if not chained or gen.drafting is not None or gen.predrafted is not None:
            return
        if predraft:
            predrafting = self._drafts.predraft(gen, block, ahead_k, plan.fan_out)
            if predrafting is not None:
                gen.predrafted, gen.predraft_for = Pending(predrafting, gen.now), post_id
                gen.predraft_verdict = None
                return
        self._chain(gen)

    # ------------------------------------------------------------------ waiting

    def _wait(self, gen: Generation) -> Waits[None]:
        """Wait for the session's next report, or a draft's answer, whichever comes first, at
        most until the request's deadline or the verifier's silence is too long (then its
        liveness decides: `cluster.routing.silence`); no wait when one is in already."""
        ready = gen.events.ready()
        if ready.done():
            return
        futures: list[Future[Any]] = [ready]
        untils = [heard_by(gen), gen.request.deadline]
        for pending in (gen.drafting, gen.predrafted):
            if pending is None:
                continue
            if pending.future is None or pending.future.done():
                if pending is gen.predrafted and gen.predraft_for in gen.posts:
                    continue  # branches in, but the verdict they follow is not yet
                return  # its answer is in: taken now
            futures.append(pending.future)
            untils.append(pending.until)
        if gen.liveness is not None:  # a silent verifier's liveness, being checked
            futures.append(gen.liveness)
            untils.append(gen.liveness_until)
        known = [until for until in untils if until is not None]
        timeout_s = None if not known else max(0.0, min(known) - gen.now())
        yield Wait(first_done(futures), timeout_s)
        check_silence(gen)

    # ------------------------------------------------------------------ committing

    def _commit(self, gen: Generation) -> Waits[list[int]]:
        """Commit what the session reported; the tokens committed (yields its waits: a failover may
        wait)."""
        tokens: list[int] = []
        last: Verdict | None = None
        answered: Posted | None = None
        for event in gen.events.take():
            item = event.item
            if isinstance(item, Exception):
                # Reports after it are the lost session's: its successor starts afresh.
                yield from self._failover.move_verifier(gen, item)
                break
            if event.post_id is not None:
                posted = gen.posts.pop(event.post_id, None)
                if posted is not None:
                    self._answered(gen, event.post_id, posted, item)
                    answered = posted
            if item.dropped:
                continue
            if item.base_length != gen.committed:
                gen.events.report(
                    ReplicaUnavailableError(
                        f"the {gen.verifier_id} reported tokens at {item.base_length}, "
                        f"the router holds {gen.committed}"
                    )
                )
                continue
            gen.commit(item.tokens)
            tokens.extend(item.tokens)
            gen.stats.num_verify_passes += 1
            last = item
        if tokens:
            self._heard(gen, len(tokens), last, answered)
        return tokens

    def _heard(
        self, gen: Generation, num_tokens: int, last: Verdict | None, answered: Posted | None
    ) -> None:
        """The gate and the plan hear of `num_tokens` committed; a speculating round's verify
        pass is timed: a running session's, as the time between its reports (a step, whatever
        waits around it); a lockstep one's, from the post of the block `answered` to its
        verdict (a lockstep session takes no step while the router drafts)."""
        now = gen.now()
        since_s, gen.heard_at = now - gen.heard_at, now
        if gen.request.draft_tokens <= 0:
            return  # the target alone by request: nothing to measure or decide
        gen.modes.observe(gen.round_mode, num_tokens, since_s)
        gen.stats.draft_mode = gen.modes.mode
        gen.stats.draft_mode_reason = gen.modes.reason + gen.lockstep_reason
        self.gate.committed(num_tokens)
        if gen.lengths.max_fan_out > 0:
            self.predraft_gate.committed(num_tokens)
        if answered is None and gen.drafting is None:
            return  # a step alone while nothing is drafted: not a speculating round
        if gen.advance is None:
            if answered is None:
                return
            verify_s = time.perf_counter() - answered.sent_at
        else:
            verify_s = since_s
        load = None if last is None else last.load
        gen.lengths.observe_verify(verify_s, gen.drafting is not None, load)
        self.recent = gen

    def _answered(self, gen: Generation, post_id: int, posted: Posted, verdict: Verdict) -> None:
        record(gen, posted, verdict)
        self._metrics().verified(time.perf_counter() - posted.sent_at)
        if gen.predraft_for == post_id:
            gen.predraft_verdict = verdict
