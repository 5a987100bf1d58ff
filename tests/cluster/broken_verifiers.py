"""Deliberately broken acceptance rules: the negative controls of the lossless-sampling test.

Each models one bug the verifier could have, and changes nothing else: the router, drafter,
sessions, KV caches, the engine's batched forward and the real `batch_rejection_sample` still
run. `test_negative_controls.py` drives them through the router and checks that the chi-square
test the real verifier passes rejects each of them. Notation as in `verifier.rejection`: p is
the target's distribution, q the drafter's, r = sum(max(0, p - q)) = TV(p, q) the chance that a
draft token is rejected.

- `residual_not_renormalised`: a drop-in for `batch_rejection_sample` whose recovered token at
  a sampled session's first rejection is drawn by walking the cumulative sum of the
  *unnormalised* residual max(0, p - q) with a uniform draw. That sum ends at r < 1, so a draw
  beyond it walks off the end of the vocabulary, where this code keeps the rejected draft
  token. A position drafted once then emits r * p + (1 - r) * q instead of p (accepted:
  min(p, q); recovered: r * max(0, p - q); rejected draft kept: (1 - r) * max(0, q - p)).
- `BonusFromDraftVerifier`: when every draft token is accepted, the bonus token is drawn from
  the drafter's distribution q at the bonus position instead of the target's p.

The controls of other tests, each a `Verifier` with one rule broken:

- `AcceptAllVerifier`: every drafted token is accepted, whatever the target says (the audit's
  and the audit API's control).
- `ReusedNoiseVerifier`: the seed-exact rule keys its noise by the seed alone, the noise of
  position 0 at every position.
- `DraftStreamVerifier`: the seed-exact rule draws the target's tokens of a block with drafts
  from another noise stream (the rejection rule's drafter stream) than a block without, so
  the output depends on how the request was drafted.
- `UnmaskedBonusVerifier`: the position after a block's last draft is not masked by the
  request's constraint (once it draws a token the grammar refuses, the session goes on
  unconstrained).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

import cluster.local
from cluster.local import LocalTandem, build_local
from cluster.presets import resolve_pair
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.gumbel import gumbel_tokens
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs, logits_to_probs_rows
from cluster.runtime.session import DRAFTER_SEED_SALT, ReplicaSession
from cluster.runtime.sparse_distribution import to_dense
from cluster.runtime.task import Task, each_alone_if_refused
from drafter.drafter import draft_sampling
from verifier.batch_layout import Batch
from verifier.batch_rejection import BatchSession, SessionOutcome, batch_rejection_sample
from verifier.step_outcomes import Acceptance, Keyed
from verifier.verifier import Verifier


def residual_not_renormalised(
    target_rows: Tensor, draft_tokens: Tensor, sessions: Sequence[BatchSession]
) -> list[SessionOutcome]:
    """`batch_rejection_sample`, except for the recovered token (see the module docstring)."""
    outcomes = batch_rejection_sample(target_rows, draft_tokens, sessions)
    batch = Batch(target_rows, draft_tokens, sessions)
    broken = []
    for i, (session, outcome) in enumerate(zip(sessions, outcomes, strict=True)):
        n = outcome.num_accepted
        if session.greedy or n == session.num_draft:
            broken.append(outcome)  # no sampled rejection: drawn as it should be
            continue
        p = batch.p_row(i, n)
        rejected = int(draft_tokens[batch.draft_start[i] + n])
        q_rows = session.draft_probs
        if q_rows is None:
            q = torch.zeros_like(p)
            q[rejected] = 1.0
        elif isinstance(q_rows, Tensor):
            q = q_rows[n].to(torch.float32)
        else:
            q = to_dense([q_rows[n]], p.shape[0])[0].to(p.device)
        residual = (p - q).clamp(min=0.0)  # the bug: never divided by its sum
        u = torch.rand(1, generator=session.generator, device=p.device)
        index = int(torch.searchsorted(residual.cumsum(0), u, right=True))
        token = rejected if index >= residual.numel() else index
        broken.append(dataclasses.replace(outcome, tokens=(*outcome.tokens[:-1], token)))
    return broken


class BonusFromDraftVerifier(Verifier):
    """A verifier whose bonus token comes from the drafter's q (`draft`, truncated as the
    drafter truncates it, to `draft_top_k`) instead of the target's p. Serial rounds and
    sampled sessions only: a pipelined round would also verify the next block's first token
    against that q, and a greedy session's rows are logits."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, draft_top_k: int) -> None:
        super().__init__(target)
        assert draft.vocab_size == target.vocab_size, "the pair must share its vocabulary"
        self._draft = draft
        self._draft_top_k = draft_top_k
        self._bonus_q: dict[int, Tensor] = {}
        """The drafter's q at the bonus position, by the id of the session's generator."""

    def _verify(self, session_id: str, block: DraftBlock, defer_bonus: bool) -> Task[Verdict]:
        if block.tokens:
            session = self._sessions.get_at(session_id, block.base_length)
            committed = session.kv.committed_tokens
            context = torch.tensor([[*committed, *block.tokens]], device=self._draft.device)
            with torch.inference_mode():
                logits = self._draft.model(context).logits[:, -1]  # [1, vocab]
            sampling = draft_sampling(session.sampling, self._draft_top_k)
            self._bonus_q[id(session.generator)] = logits_to_probs(logits, sampling)
        return (yield from super()._verify(session_id, block, defer_bonus))

    def _accept(self, batch: list[Acceptance]) -> list[SessionOutcome | Exception]:
        swapped = []
        for item in batch:
            q = self._bonus_q.pop(id(item.session.generator), None)
            if q is not None:
                # The last row is read only when all k draft tokens are accepted: the bonus.
                rows = torch.cat([item.rows[:-1], q.to(item.rows.device, item.rows.dtype)])
                item = dataclasses.replace(item, rows=rows)
            swapped.append(item)
        return super()._accept(swapped)


class AcceptAllVerifier(Verifier):
    """Accepts every drafted token of a block, whatever the target says."""

    def _commit(
        self, session: ReplicaSession, block: DraftBlock, outcome: SessionOutcome, load: Any
    ) -> Verdict:
        if block.tokens:
            outcome = SessionOutcome(len(block.tokens), block.tokens, None)
        return super()._commit(session, block, outcome, load)


def reused_noise_draws(batch: list[Keyed]) -> list[list[int]]:
    """`seed_exact_draws` with every row keyed at position 0 (the broken rule)."""
    probs = logits_to_probs_rows(
        torch.cat([item.logits for item in batch]),
        [item.sampling for item in batch for _ in range(item.logits.shape[0])],
    )
    seeds = [item.seed for item in batch for _ in range(item.logits.shape[0])]
    tokens = gumbel_tokens(probs, seeds, [0] * len(seeds))
    out, start = [], 0
    for item in batch:
        out.append(tokens[start : start + item.logits.shape[0]])
        start += item.logits.shape[0]
    return out


class ReusedNoiseVerifier(Verifier):
    """Seed-exact draws keyed by the seed alone: position 0's noise at every position."""

    def _draw_seed_exact(self, batch: list[Keyed]) -> list[list[int] | Exception]:
        return each_alone_if_refused(reused_noise_draws, batch)


class DraftStreamVerifier(Verifier):
    """Seed-exact draws of a block with drafts from the drafter's noise stream (the request's
    seed XOR `DRAFTER_SEED_SALT`), of a block without from the request's own."""

    def _seed_exact_outcome(
        self, logits: Any, session: ReplicaSession, block: DraftBlock, defer_bonus: bool
    ) -> Task[SessionOutcome]:
        if not block.tokens:
            return (yield from super()._seed_exact_outcome(logits, session, block, defer_bonus))
        session.seed ^= DRAFTER_SEED_SALT  # read before the draw's first yield
        try:
            return (yield from super()._seed_exact_outcome(logits, session, block, defer_bonus))
        finally:
            session.seed ^= DRAFTER_SEED_SALT


class UnmaskedBonusVerifier(Verifier):
    """Leaves the position after a block's last draft unmasked by the request's constraint."""

    def _mask(self, logits: Tensor, allowed: Tensor) -> Tensor:
        allowed = allowed.clone()
        allowed[-1] = True  # the bonus position left unmasked
        return super()._mask(logits, allowed)

    def _follow_constraint(self, session: ReplicaSession, tokens: tuple[int, ...]) -> None:
        try:
            super()._follow_constraint(session, tokens)
        except InvalidArgumentError:
            session.matcher = None  # the fault broke the grammar: unconstrained from here


def local_with(verifier_type: type[Verifier], **kwargs: Any) -> LocalTandem:
    """The tiny pair in this process (`build_local` with `kwargs`), its verifier a
    `verifier_type`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster.local, "Verifier", verifier_type)
        return build_local(resolve_pair("tiny", device="cpu"), **kwargs)
