"""The drafter component: a small causal LM proposes the next tokens of a session.

A plain class (no Ray, no gRPC). Each session holds the committed tokens as the router last
reported them, a KV cache in the replica's paged pool, the drafter's own sampling settings and a
seeded generator. `draft` is a task of the replica's engine: it first appends the tokens
committed since the last block (the last verdict), then proposes `num_tokens` tokens, one engine
step each (every session mid-draft shares each step's forward pass; sessions join and leave
between steps), reusing its cache across blocks: positions that the verdict kept stay cached,
rejected ones are rolled back.

Greedy requests draft greedily and send no q (q is one-hot at the drafted token). Sampled
requests draft from the request's distribution, optionally truncated further to the drafter's
own `top_k`, and send that exact truncated q as a sparse distribution: the acceptance rule only
needs the q the token was really drawn from, so truncation costs acceptance, never exactness.
Seed-exact requests (`SamplingParams.seed_exact`) draw each token with the target's own noise
at its position (`cluster.runtime.gumbel`, keyed by the request's unsalted seed) and send no q:
the verifier accepts such a token exactly when it is the target's own draw.

Saguaro-style drafting (`DrafterConfig.saguaro_scale`, off by default): sampled drafts are drawn
from q' (q with its top tokens damped, `cluster.runtime.saguaro`) and q' is what is sent, so
the rule stays exact while the verifier's corrections lean towards the draft's favourites, the
tokens pre-drafted branches guess.

Pre-drafting (`predraft`): while a block is verified, the next block is drafted for each of
the likely outcomes of that verification, each on a fork of the session (`drafter.branches`),
for greedy, seed-exact and sampled sessions alike; the session itself stays at its committed
tokens. A call with more branches than `MAX_PREDRAFT_FAN_OUT` is refused before anything of it
runs (`check_fan_out`): the router never asks for more, and each branch is a fork of the
session's KV and a row in every step of its block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

import torch

from cluster.runtime.block_runner import ModelRunner, PoolExhaustedError
from cluster.runtime.component import SessionComponent, submitted
from cluster.runtime.constraint import (
    Constraint,
    TokenMatcher,
    mask_logits,
    masks_ahead,
    wait_for,
)
from cluster.runtime.draft_block import DraftBlock, StepLoad
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import (
    DRAFTER_SEED_SALT,
    ReplicaSession,
    check_seed,
    check_token_ids,
    make_generator,
)
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.runtime.task import Batched, Task
from cluster.runtime.token_choice import argmax_rows
from drafter.branches import BranchDraw, branch_task, fork_id
from drafter.config import DrafterConfig
from drafter.draws import DraftRow, sample_step, seed_exact_step


def draft_sampling(request: SamplingParams, top_k: int) -> SamplingParams:
    """The distribution the drafter samples from for a request's settings."""
    if request.is_greedy or top_k == 0:
        return request
    limit = top_k if request.top_k == 0 else min(request.top_k, top_k)
    return replace(request, top_k=limit)


def check_fan_out(branches: Sequence[Branch]) -> None:
    """Raise `InvalidArgumentError` naming the limit when a pre-draft asks for more than
    `MAX_PREDRAFT_FAN_OUT` branches, the most a request may have pre-drafted (the router refuses
    a request's `predraft_fan_out` above it, `cluster.routing.request`); each branch would be
    a fork of the session's KV and a row in each of its block's steps."""
    if len(branches) > MAX_PREDRAFT_FAN_OUT:
        raise InvalidArgumentError(
            f"a pre-draft takes at most {MAX_PREDRAFT_FAN_OUT} branches (MAX_PREDRAFT_FAN_OUT), "
            f"got {len(branches)}"
        )


class Drafter(SessionComponent[DrafterConfig]):
    """Proposes draft blocks with a small model, one session per request."""

    def __init__(
        self,
        draft: LoadedModel,
        config: DrafterConfig | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        super().__init__(draft, config or DrafterConfig(), runner)
        scale = self.config.saguaro_scale
        self._saguaro = None if scale is None else (scale, self.config.saguaro_top)
        """Sampled drafts draw from q damped by (scale, top) (`cluster.runtime.saguaro`)."""

    def _headroom_tokens(self) -> int:
        return self.config.max_draft_tokens

    def _session_sampling(self, sampling: SamplingParams, seed: int) -> tuple[SamplingParams, int]:
        """The drafter's own distribution (`draft_sampling`) and its own salted seed; under the
        seed-exact rule the request's seed itself, whose noise the verifier shares."""
        check_seed(seed)  # before salting, so the message names the caller's seed
        own = seed if sampling.seed_exact else seed ^ DRAFTER_SEED_SALT
        return draft_sampling(sampling, self.config.top_k), own

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> DraftBlock:
        """Check the session is at `base_length`, drop its tokens from `truncate_to` on, append
        `appended_tokens`, then draft `num_tokens` more.

        `truncate_to` undoes a block the router let this drafter assume accepted (pipelining)
        when the verdict rejected part of it.
        """
        return self.submit_draft(
            session_id, base_length, appended_tokens, num_tokens, truncate_to
        ).result()

    def submit_draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> Future[DraftBlock]:
        """`draft` without waiting: a future of the block."""
        task = self._draft(session_id, base_length, tuple(appended_tokens), num_tokens, truncate_to)
        return submitted(lambda: self._engine.submit(task, key=session_id))

    def _draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: tuple[int, ...],
        num_tokens: int,
        truncate_to: int | None,
    ) -> Task[DraftBlock]:
        session = self._sessions.get_at(session_id, base_length)
        keep = self._checked_catch_up(base_length, appended_tokens, num_tokens, truncate_to)
        self._sessions.check_context(keep + len(appended_tokens) + num_tokens)
        # The last block's drafts stay cached as far as the router's tokens agree with them.
        session.kv.commit_at(keep, appended_tokens)
        matcher = self._follow(session)
        if session.constrained and matcher is None:
            num_tokens = 0  # a constraint this drafter cannot follow: the target goes alone

        drafted: list[int] = []
        draft_probs: list[SparseDistribution] = []
        load = None
        for _ in range(num_tokens):
            # One engine step per token: other sessions' draft steps join the same pass. Each
            # drafted token joins the sequence as a tentative token, fed by the next step.
            # Under a constraint, its mask at this position is computed meanwhile.
            mask = masks_ahead(matcher, ()) if matcher is not None else None
            try:
                logits = yield from self._forward(session, 1)
            finally:
                allowed = wait_for(mask)
            assert logits is not None  # one logit row is always computed
            load = self._engine.step_load()
            if allowed is not None:
                logits = mask_logits(logits, allowed)
                if not bool(torch.isfinite(logits).any()):
                    break  # nothing the constraint allows is in this draft's vocabulary
            if session.sampling.is_greedy:
                drafted.append(int(argmax_rows(logits)[0]))
            elif session.sampling.seed_exact:
                # The target's noise at this position: the draft is the target's own draw
                # whenever the two distributions agree on the argmax (`cluster.runtime.gumbel`).
                position = session.kv.length
                row = DraftRow(logits, session.sampling, key=(session.seed, position))
                drafted.append((yield Batched(seed_exact_step, row)))
            else:
                # Sampled with every other sampled session of the step, in one call.
                row = DraftRow(logits, session.sampling, session.generator, saguaro=self._saguaro)
                token, q = yield Batched(sample_step, row)
                drafted.append(token)
                draft_probs.append(q)
            session.kv.extend(drafted[-1:])
            if matcher is not None:
                matcher.consume(drafted[-1:])
            if self._unsure(logits[0]):
                break
        if matcher is not None:
            matcher.rollback(len(drafted))  # it stands after the committed tokens
        return DraftBlock(
            base_length=session.committed_length,
            tokens=tuple(drafted),
            # Only the rejection rule reads q: a greedy or seed-exact draft is a function of
            # its position, and the verifier accepts it by equality.
            draft_probs=tuple(draft_probs) if draft_probs else None,
            load=load,
        )

    def predraft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        block: Sequence[int],
        branches: Sequence[Branch],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> list[PreDraft]:
        """Bring the session to its committed tokens (as `draft` does: `truncate_to`, then
        `appended_tokens`), then draft `num_tokens` tokens after each of `branches`, the likely
        outcomes of verifying `block` (`drafter.branches`), all at once, each drawn as the
        session draws (greedy, seed-exact or sampled). Branches that do not fit in the KV
        pool, and every branch of a constrained session, are left out; the session itself
        does not change past its committed tokens (a sampled session's generator gives one
        draw per branch, its seed)."""
        return self.submit_predraft(
            session_id, base_length, appended_tokens, block, branches, num_tokens, truncate_to
        ).result()

    def submit_predraft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        block: Sequence[int],
        branches: Sequence[Branch],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> Future[list[PreDraft]]:
        """`predraft` without waiting: a future of the branches drafted (failed with the
        refusal of too many branches, which no engine step waits for)."""
        asked = tuple(branches)
        task = self._forks(
            session_id, base_length, tuple(appended_tokens), tuple(block), asked,
            num_tokens, truncate_to,
        )  # fmt: skip

        def fork() -> Future[list[Future[PreDraft]]]:
            check_fan_out(asked)  # before the session's queue holds anything of it
            return self._engine.submit(task, key=session_id)

        return gathered(submitted(fork), self._engine.step_load)

    def _forks(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: tuple[int, ...],
        block: tuple[int, ...],
        branches: tuple[Branch, ...],
        num_tokens: int,
        truncate_to: int | None,
    ) -> Task[list[Future[PreDraft]]]:
        """The session's part, on the engine thread: commit, then fork a branch task for each
        branch (they run as tasks of their own, each on its fork)."""
        session = self._sessions.get_at(session_id, base_length)
        keep = self._checked_catch_up(base_length, appended_tokens, num_tokens, truncate_to)
        check_token_ids(block, self.vocab_size, "block")
        for branch in branches:
            if not 0 <= branch.accepted <= len(block) or branch.rank < 0:
                raise InvalidArgumentError(
                    f"a branch needs 0 <= accepted <= {len(block)} and rank >= 0, got {branch}"
                )
        self._sessions.check_context(keep + len(appended_tokens) + len(block) + 1 + num_tokens)
        session.kv.commit_at(keep, appended_tokens)
        if session.constrained:
            return []
        committed = list(session.kv.committed_tokens)
        # After the commit the session's KV holds at most its committed tokens.
        held = min(self._runner.length(session.kv.seq_id), len(committed))
        futures = []
        for branch in branches:
            # Drawn before the fork may fail, so the session's generator advances the same
            # whatever room the pool has.
            draw = self._branch_draw(session)
            child = fork_id(session.kv.seq_id)
            try:
                self._runner.fork(session.kv.seq_id, child, held)
            except PoolExhaustedError:
                continue  # no room for this branch: it is a guess, not a promise
            skip = block[branch.accepted] if branch.accepted < len(block) else None
            prefix = committed + list(block[: branch.accepted])
            task = branch_task(self._runner, child, prefix, branch, skip, num_tokens, draw)
            futures.append(self._engine.submit(task, key=child, closes=True))
        return futures
        yield  # pragma: no cover - makes this a task

    def _branch_draw(self, session: ReplicaSession) -> BranchDraw:
        """How a branch of `session` draws (engine thread): greedily, with the request's
        noise, or sampled with a generator of its own, seeded by a draw of the session's."""
        sampling = session.sampling
        if sampling.is_greedy:
            return BranchDraw(sampling)
        if sampling.seed_exact:
            return BranchDraw(sampling, seed=session.seed)
        generator = session.generator
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        return BranchDraw(
            sampling, generator=make_generator(seed, generator.device), saguaro=self._saguaro
        )

    def _checked_catch_up(
        self,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None,
    ) -> int:
        """Check a draft call's catch-up (`truncate_to`, then `appended_tokens`) and its length;
        the length the session keeps before appending."""
        if not 1 <= num_tokens <= self.config.max_draft_tokens:
            raise InvalidArgumentError(
                f"num_tokens must be in 1..{self.config.max_draft_tokens}, got {num_tokens}"
            )
        keep = base_length if truncate_to is None else truncate_to
        if not 1 <= keep <= base_length:
            raise InvalidArgumentError(
                f"truncate_to must be in 1..{base_length} (the base length), got {truncate_to}"
            )
        check_token_ids(appended_tokens, self.vocab_size, "appended_tokens")
        return keep

    def _matcher(
        self, constraint: Constraint | None, prompt_tokens: Sequence[int]
    ) -> TokenMatcher | None:
        """The session's matcher; None when this drafter cannot follow the constraint (a
        tokenizer the grammar engine cannot read): it then drafts nothing for the session."""
        try:
            return super()._matcher(constraint, prompt_tokens)
        except InvalidArgumentError:
            return None

    def _follow(self, session: ReplicaSession) -> TokenMatcher | None:
        """The session's matcher, brought to its committed tokens; None, for good, when they
        break the constraint as this drafter reads it."""
        matcher = session.matcher
        if matcher is None:
            return None
        try:
            matcher.sync(session.kv.committed_from(matcher.constraint.prompt_length))
        except InvalidArgumentError:
            session.matcher = None
        return session.matcher

    def _unsure(self, logits: torch.Tensor) -> bool:
        """Whether the draft model's best next token has less than min_confidence."""
        if self.config.min_confidence <= 0.0:
            return False
        return float(logits.float().softmax(-1).max()) < self.config.min_confidence


def gathered(
    forking: Future[list[Future[PreDraft]]], load: Callable[[], StepLoad | None] = lambda: None
) -> Future[list[PreDraft]]:
    """One future of every branch's result, in order, once the session's part has forked
    them, each with the engine's `load()` when the last ended; a branch that failed is left
    out (a guess lost), the session's own error is raised."""
    out: Future[list[PreDraft]] = Future()

    def forked(done: Future[list[Future[PreDraft]]]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        branches = done.result()
        if not branches:
            out.set_result([])
            return
        left = [len(branches)]

        def drafted(_: Future[PreDraft]) -> None:
            left[0] -= 1
            if left[0] == 0:
                now = load()
                results = [b.result() for b in branches if b.exception() is None]
                out.set_result([replace(b, load=now) for b in results])

        for branch in branches:
            branch.add_done_callback(drafted)

    forking.add_done_callback(forked)
    return out
