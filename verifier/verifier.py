"""The verifier component: the target model checks draft blocks, many sessions per forward pass.

A plain class (no Ray, no gRPC): sessions by id, each with the committed tokens, a KV cache in
the replica's paged pool, the request's sampling settings and a seeded generator. `verify` is a
task of the replica's engine: the target runs over the last committed token plus the block in
the engine's next batched step (beside every other session's block), the `k + 1` rows of logits
become the distribution actually sampled from (temperature, top-k, top-p), and after the step
every sampled block of the step gets its p in one `logits_to_probs_rows` call (each row under its
session's settings) and is accepted in one `batch_rejection_sample` call (each session with its
own seeded generator, so a request gets the same tokens alone or batched). A greedy
block needs only the argmaxes of its rows: its task takes them and applies the greedy rule
(`verifier.rejection.greedy_accept`) itself, with no batched call. The emitted tokens are
committed and the cache rolled back past the rejected positions (whole KV blocks freed). A block
with no tokens is plain target decoding through the same path. A deferred bonus keeps only what
the next block needs (`SessionOutcome.deferred_row`: an argmax, the nonzero entries, or a row).
A session opened with an `Advance` runs: it advances on its own in every engine step
(`verifier.running_sessions`), each step alone this same verify pass over an empty block.
`reference` is the audit's: a finished request replayed through the plain target, in the
caller's thread and between the engine's calls (`verifier.audit_replica`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

import torch

from cluster.runtime.advance import Advance
from cluster.runtime.audit import Replay
from cluster.runtime.block_runner import ModelRunner
from cluster.runtime.call_scope import caller_gone
from cluster.runtime.component import SessionComponent, submitted
from cluster.runtime.constraint import Constraint, mask_logits, masks_ahead, wait_for
from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.errors import InvalidArgumentError, StaleBaseError
from cluster.runtime.models import LoadedModel
from cluster.runtime.rebase import reconcile
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaSession, check_token_ids
from cluster.runtime.sparse_distribution import to_dense
from cluster.runtime.task import Batched, Task, each_alone_if_refused
from verifier.audit_replica import ReferenceReplayer
from verifier.batch_rejection import (
    BatchSession,
    SessionOutcome,
)
from verifier.config import OWN_DTYPE, VerifierConfig
from verifier.rejection import greedy_accept
from verifier.running_sessions import RunningSessions
from verifier.step_outcomes import (
    Acceptance,
    Keyed,
    Scored,
    accept_together,
    greedy_outcome,
    on_device,
    probs_by_block,
    seed_exact_draws,
)


class Verifier(SessionComponent[VerifierConfig]):
    """Verifies draft blocks against the target model; every block pending on the replica is
    verified in one forward pass and accepted in one vectorised call."""

    def __init__(
        self,
        target: LoadedModel,
        config: VerifierConfig | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        super().__init__(target, config or VerifierConfig(), runner)
        self._target = target
        self.replayer = ReferenceReplayer(
            target, self._engine.has_work, max_context_tokens=self.config.max_context_tokens
        )
        """The audit's replays (`reference`), off the engine's thread."""
        self._running = RunningSessions(self._engine, self._sessions, self._verify_at)
        """Sessions opened with an `Advance`, stepped on their own."""

    def _headroom_tokens(self) -> int:
        return self.config.max_block_tokens + 1

    def verify(self, session_id: str, block: DraftBlock, defer_bonus: bool = False) -> Verdict:
        """Check `block` against the target, commit what is emitted, return the verdict.

        With `defer_bonus`, a block whose every token is accepted emits no bonus token: the
        target's distribution at the next position is kept, and the next block's first token
        is verified against it. This is the same acceptance rule applied across two passes,
        so it stays lossless; it lets a block drafted ahead (pipelining) be used as it is.
        """
        return self.submit_verify(session_id, block, defer_bonus).result()

    def submit_open(  # type: ignore[override]
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
        advance: Advance | None = None,
        sink: Callable[[Verdict | Exception], None] | None = None,
    ) -> Future[int]:
        """`SessionComponent.submit_open`; with `advance` (and `sink`, where its own steps
        report), the session is running: once open, it is in every engine step, verifying a
        block sent to it if one is there, else taking the target's own next token, until
        `advance` says its output has ended (`cluster.runtime.advance`;
        `verifier.running_sessions`)."""
        if (advance is None) != (sink is None):
            raise InvalidArgumentError("a running session needs both advance and sink")
        # Its own steps stop once whoever opened it has gone (a stream ended, an open given up).
        on_open = (
            None
            if advance is None or sink is None
            else partial(self._running.start, advance, sink, caller_gone())
        )
        return super().submit_open(
            session_id,
            prompt_tokens,
            sampling,
            seed,
            time_limit_s=time_limit_s,
            max_new_tokens=max_new_tokens,
            resumed=resumed,
            constraint=constraint,
            on_open=on_open,
        )

    def submit_verify(
        self, session_id: str, block: DraftBlock, defer_bonus: bool = False
    ) -> Future[Verdict]:
        """`verify` without waiting: a future of the verdict."""
        task = self._verify(session_id, block, defer_bonus)
        return submitted(lambda: self._engine.submit(task, key=session_id))

    def reference(
        self,
        prompt_tokens: Sequence[int],
        served_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        dtype: str = OWN_DTYPE,
    ) -> Replay:
        """Replay a finished greedy or seed-exact request through the plain target, in the
        calling thread, yielding to the engine's calls between chunks
        (`verifier.audit_replica`): the target's own token and top-2 gap at each served
        position. `dtype`: "" the target as served, "float32" a float32 copy of it."""
        return self.replayer.reference(prompt_tokens, served_tokens, sampling, seed, dtype)

    def _verify(self, session_id: str, block: DraftBlock, defer_bonus: bool) -> Task[Verdict]:
        """A block sent by the router, verified from where its session stands when the engine
        takes it (`cluster.runtime.rebase.reconcile`): a running session may have advanced since
        the block's base, or not be where the block assumed (it is then dropped, committing
        nothing)."""
        session = self._sessions.get(session_id)
        committed = session.committed_length
        if block.base_length > committed:
            raise StaleBaseError(
                f"session {session_id!r} has committed length {committed}, but the block is "
                f"based on length {block.base_length}"
            )
        if len(block.tokens) > self.config.max_block_tokens:
            raise InvalidArgumentError(
                f"block of {len(block.tokens)} tokens exceeds the limit of "
                f"{self.config.max_block_tokens}"
            )
        check_token_ids(block.tokens, self.vocab_size, "block.tokens")
        check_token_ids(block.assumed, self.vocab_size, "block.assumed")
        if block.assumed or block.base_length < committed:
            since_base = session.kv.committed_from(block.base_length)
            standing = reconcile(since_base, block.assumed, block.tokens)
            if standing.dropped:
                return Verdict(
                    base_length=committed,
                    num_accepted=0,
                    tokens=(),
                    committed_length=committed,
                    num_matched=standing.skip,
                    dropped=True,
                )
            skip = standing.skip
            probs = block.draft_probs
            block = DraftBlock(
                base_length=committed,
                tokens=block.tokens[skip:],
                draft_probs=None if probs is None else tuple(probs[skip:]),
            )
            verdict = yield from self._verify_at(session, block, defer_bonus)
            return replace(verdict, num_matched=skip)
        return (yield from self._verify_at(session, block, defer_bonus))

    def _verify_at(
        self, session: ReplicaSession, block: DraftBlock, defer_bonus: bool
    ) -> Task[Verdict]:
        """One verify pass of `block`, based where `session` stands: the target's rows at its
        positions in the engine's next step, the acceptance rule, the emitted tokens
        committed. A running session stops advancing once they end its output."""
        num_draft = len(block.tokens)
        self._sessions.check_context(session.committed_length + num_draft + 1)
        greedy = session.sampling.is_greedy
        if greedy and block.draft_probs is not None:
            # Greedy acceptance never reads q, but a malformed one is still refused (rare:
            # drafters send no q for greedy requests).
            to_dense(block.draft_probs, self.vocab_size)
        stored = session.next_row
        # p at the block positions plus the bonus position; the first comes from the stored row
        # when the last verdict deferred its bonus (the cache then holds every committed token).
        num_rows = num_draft + (stored is None)
        session.kv.drop_tentative()  # a block whose verdict never came (its call failed)
        masks = self._masks_ahead(session, block.tokens)
        session.kv.extend(block.tokens)
        if greedy and masks is None:
            # Greedy acceptance reads only argmaxes: the engine takes them for the whole step
            # at once, and the rule is applied to these k + 1 ids (no row copied).
            best = yield from self._argmaxes(session, num_rows)
            load = self._engine.step_load() if best is not None else None
            targets = [] if stored is None else [int(stored)]  # type: ignore[arg-type]
            outcome = SessionOutcome(
                *greedy_accept(block.tokens, targets + (best or []), defer_bonus)
            )
            return self._commit(session, block, outcome, load)
        try:
            logits = yield from self._forward(session, num_rows)
        finally:
            allowed = wait_for(masks)
        if allowed is not None and logits is not None:
            # Row i of `allowed` is the position after i drafts; the stored row (position 0)
            # was masked when it was computed.
            logits = self._mask(logits, allowed[len(allowed) - logits.shape[0] :])
        load = self._engine.step_load() if logits is not None else None
        if greedy:
            outcome = greedy_outcome(logits, stored, block.tokens, defer_bonus)
        elif session.sampling.seed_exact:
            outcome = yield from self._seed_exact_outcome(logits, session, block, defer_bonus)
        else:
            outcome = yield from self._sampled_outcome(logits, session, block, defer_bonus)
        return self._commit(session, block, outcome, load)

    def _commit(
        self,
        session: ReplicaSession,
        block: DraftBlock,
        outcome: SessionOutcome,
        load: StepLoad | None,
    ) -> Verdict:
        """Commit a verify pass's outcome to its session: the verdict."""
        session.next_row = outcome.deferred_row
        # The accepted drafts stay cached, the rejected ones go; a newly emitted token (a
        # correction or the bonus) is fed with the next block.
        session.kv.commit_at(block.base_length, outcome.tokens)
        self._follow_constraint(session, outcome.tokens)
        advance = session.advance
        if advance is not None and advance.ended(block.base_length, outcome.tokens):
            session.advance = None  # its output is over: the router closes it
        return Verdict(
            base_length=block.base_length,
            num_accepted=outcome.num_accepted,
            tokens=outcome.tokens,
            committed_length=session.committed_length,
            bonus_deferred=outcome.deferred_row is not None,
            load=load,
        )

    def _follow_constraint(self, session: ReplicaSession, tokens: tuple[int, ...]) -> None:
        """Advance the session's grammar matcher (if it is constrained) past the tokens just
        committed; InvalidArgumentError if the grammar refuses them."""
        if session.matcher is not None:
            session.matcher.consume(tokens)

    def _masks_ahead(
        self, session: ReplicaSession, drafts: tuple[int, ...]
    ) -> Future[torch.Tensor] | None:
        """The allowed tokens at the block's k + 1 positions, computed on a worker thread while
        the forward pass runs (None when the session is unconstrained). The matcher is first
        brought to the committed tokens: a verdict that never reached the router (a failed
        call) may have left it ahead."""
        matcher = session.matcher
        if matcher is None:
            return None
        constraint = matcher.constraint
        matcher.sync(session.kv.committed_from(constraint.prompt_length))
        return masks_ahead(matcher, drafts)

    def _mask(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The logits with what the constraint forbids at each row's position set to -inf."""
        return mask_logits(logits, allowed)

    def _sampled_outcome(
        self,
        logits: torch.Tensor | None,
        session: ReplicaSession,
        block: DraftBlock,
        defer_bonus: bool,
    ) -> Task[SessionOutcome]:
        """p as used, made and accepted with every other sampled block of the step in one call
        each."""
        if logits is None:
            logits = torch.empty(0, self.vocab_size, device=self._target.device)
        outcome: SessionOutcome = yield Batched(
            self._score_and_accept,
            Scored(
                logits,
                session.sampling,
                block.tokens,
                BatchSession(
                    num_draft=len(block.tokens),
                    greedy=False,
                    generator=session.generator,
                    draft_probs=on_device(block.draft_probs, self._target.device),
                    defer_bonus=defer_bonus,
                    stored_row=session.next_row,
                ),
            ),
        )
        return outcome

    def _seed_exact_outcome(
        self,
        logits: torch.Tensor | None,
        session: ReplicaSession,
        block: DraftBlock,
        defer_bonus: bool,
    ) -> Task[SessionOutcome]:
        """The target's own seed-exact draw at each of the block's positions, made with every
        other seed-exact block of the step in one call, then the greedy rule on those draws:
        a drafted token is accepted exactly when it is the target's draw."""
        stored = session.next_row
        targets: list[int] = [] if stored is None else [int(stored)]  # type: ignore[arg-type]
        if logits is not None and logits.shape[0]:
            # Row i is the position after the committed tokens and the block's first i drafts,
            # less the stored row's position when the last bonus was deferred.
            first = block.base_length + len(targets)
            drawn: list[int] = yield Batched(
                self._draw_seed_exact, Keyed(logits, session.sampling, session.seed, first)
            )
            targets += drawn
        num_accepted, tokens, deferred = greedy_accept(block.tokens, targets, defer_bonus)
        return SessionOutcome(num_accepted, tokens, deferred)

    def _draw_seed_exact(self, batch: list[Keyed]) -> list[list[int] | Exception]:
        """Every seed-exact block of a step: p as used from one `logits_to_probs_rows` call,
        the draws from one `gumbel_tokens` call; only the blocks whose logits the calls refuse
        fail (`each_alone_if_refused`)."""
        return each_alone_if_refused(seed_exact_draws, batch)

    def _score_and_accept(self, batch: list[Scored]) -> list[SessionOutcome | Exception]:
        """Every sampled block of a step: its logits to p as used, all rows in one call (each
        under its own session's settings), then all accepted in one call."""
        results: list[SessionOutcome | Exception | None] = []
        scored: list[Acceptance] = []
        for item, rows in zip(batch, probs_by_block(batch), strict=True):
            if isinstance(rows, Exception):
                results.append(rows)
                continue
            results.append(None)
            scored.append(Acceptance(rows, item.draft_tokens, item.session))
        accepted = iter(self._accept(scored) if scored else [])
        return [next(accepted) if result is None else result for result in results]

    def _accept(self, batch: list[Acceptance]) -> list[SessionOutcome | Exception]:
        """Accept every block of a step in one `batch_rejection_sample` call. A refused batch
        changes nothing; only the blocks at fault then fail (`each_alone_if_refused`)."""
        return each_alone_if_refused(accept_together, batch)
