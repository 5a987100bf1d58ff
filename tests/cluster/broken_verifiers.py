"""Deliberately broken acceptance rules: the negative controls of the lossless-sampling test.

Each models one bug the verifier could have, and changes nothing else: the router, drafter,
sessions, KV caches and the real `rejection_sample` still run. `test_negative_controls.py`
drives them through the router and checks that the chi-square test the real verifier passes
rejects each of them. Notation as in `verifier.rejection`: p is the target's distribution, q
the drafter's, r = sum(max(0, p - q)) = TV(p, q) the chance that a draft token is rejected.

- `residual_not_renormalised`: a drop-in for `rejection_sample` whose recovered token at the
  first rejection is drawn by walking the cumulative sum of the *unnormalised* residual
  max(0, p - q) with a uniform draw. That sum ends at r < 1, so a draw beyond it walks off the
  end of the vocabulary, where this code keeps the rejected draft token. A position drafted
  once then emits r * p + (1 - r) * q instead of p (accepted: min(p, q); recovered:
  r * max(0, p - q); rejected draft kept: (1 - r) * max(0, q - p)).
- `BonusFromDraftVerifier`: when every draft token is accepted, the bonus token is drawn from
  the drafter's distribution q at the bonus position instead of the target's p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from drafter.drafter import draft_sampling
from verifier.rejection import rejection_sample
from verifier.runtime.models import LoadedModel
from verifier.runtime.sampling import logits_to_probs
from verifier.runtime.session import ReplicaSession
from verifier.verifier import Verifier


def residual_not_renormalised(
    target_probs: Tensor,  # [k + 1, vocab]
    draft_tokens: Tensor,  # [k] int64
    draft_probs: Tensor | None,  # [k, vocab]; None: one-hot q
    generator: torch.Generator | None,
) -> tuple[Tensor, int]:
    """`rejection_sample`, except for the recovered token (see the module docstring)."""
    emitted, num_accepted = rejection_sample(target_probs, draft_tokens, draft_probs, generator)
    if num_accepted == draft_tokens.shape[0]:
        return emitted, num_accepted  # no rejection: the bonus token, drawn as it should be
    p = target_probs[num_accepted].to(torch.float32)
    rejected = int(draft_tokens[num_accepted])
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[rejected] = 1.0
    else:
        q = draft_probs[num_accepted].to(torch.float32)
    residual = (p - q).clamp(min=0.0)  # the bug: never divided by its sum
    u = torch.rand(1, generator=generator, device=p.device)
    index = int(torch.searchsorted(residual.cumsum(0), u, right=True))
    token = rejected if index >= residual.numel() else index
    broken = emitted.clone()
    broken[-1] = token
    return broken, num_accepted


class BonusFromDraftVerifier(Verifier):
    """A verifier whose bonus token comes from the drafter's q (`draft`, truncated as the
    drafter truncates it, to `draft_top_k`) instead of the target's p. Serial rounds only: a
    pipelined round would also verify the next block's first token against that q."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, draft_top_k: int) -> None:
        super().__init__(target)
        assert draft.vocab_size == target.vocab_size, "the pair must share its vocabulary"
        self._draft = draft
        self._draft_top_k = draft_top_k

    def _target_probs(self, session: ReplicaSession, block: Sequence[int]) -> Tensor:
        rows = super()._target_probs(session, block)  # [k + 1, vocab]
        if not block:
            return rows  # an empty block is the target alone: its one row is no bonus
        context = torch.tensor([[*session.tokens, *block]], device=self._draft.device)
        with torch.inference_mode():
            logits = self._draft.model(context).logits[:, -1]  # [1, vocab]
        q = logits_to_probs(logits, draft_sampling(session.sampling, self._draft_top_k))
        # Row k is read only when all k draft tokens are accepted: for the bonus token.
        return torch.cat([rows[:-1], q.to(rows.device, rows.dtype)])
