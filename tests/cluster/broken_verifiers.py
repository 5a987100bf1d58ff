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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.engine import Task
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs, to_dense
from drafter.drafter import draft_sampling
from verifier.batch_layout import Batch
from verifier.batch_rejection import BatchSession, SessionOutcome, batch_rejection_sample
from verifier.step_outcomes import Acceptance
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
