"""Lossless acceptance of a draft block: the rejection rule of Leviathan et al. / Chen et al.

Contract: a pure function of tensors and an explicit `torch.Generator`; no model, no I/O. Given
the target's distributions p and the drafter's distributions q (both *as actually used*, after
temperature / top-k / top-p), the emitted tokens are distributed exactly as tokens sampled from
the target alone (docs/architecture.md, invariant 1). With one-hot (greedy) target rows and a
deterministic drafter it reduces to the classic greedy rule: keep the longest prefix that
matches the target's argmax, then emit the argmax.

Glossary (positions are 0-based; p_i = target_probs[i], q_i = draft_probs[i])
    draft tokens      the k tokens x_0..x_{k-1} the drafter proposed.
    accepted tokens   the longest prefix of draft tokens that passed the test
                      u_i < p_i(x_i) / q_i(x_i); `num_accepted` counts them (0..k).
    recovered token   sampled from norm(max(0, p_i - q_i)) at the first rejected position i.
    bonus token       sampled from p_k when all k draft tokens are accepted.
    output tokens     accepted tokens + one recovered-or-bonus token (num_accepted + 1 of them).

Random-draw protocol (fixed, because tests replay it): when k > 0, one
`u = torch.rand(k, generator=generator)` first; then exactly one
`torch.multinomial(row, 1, generator=generator)` for the recovered or bonus token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError


def _rows_are_distributions(probs: Tensor) -> bool:  # probs: [rows, vocab]
    # One host sync. NaN fails every comparison; +inf makes a row's mass infinite.
    row_mass = probs.sum(dim=-1)  # [rows]
    low_prob, low_mass, high_mass = torch.stack([probs.min(), *torch.aminmax(row_mass)]).tolist()
    return bool(low_prob >= 0 and low_mass > 0 and high_mass < math.inf)


def _check_inputs(
    target_probs: Tensor,  # [k + 1, vocab]
    draft_tokens: Tensor,  # [k]
    draft_probs: Tensor | None,  # [k, vocab]
) -> None:
    if (
        not isinstance(target_probs, Tensor)
        or target_probs.dim() != 2
        or not target_probs.is_floating_point()
    ):
        raise InvalidArgumentError(
            "target_probs must be a 2-D floating-point tensor [k + 1, vocab]"
        )
    if not isinstance(draft_tokens, Tensor) or draft_tokens.dim() != 1:
        raise InvalidArgumentError("draft_tokens must be a 1-D tensor [k]")
    if draft_tokens.dtype != torch.int64:
        raise InvalidArgumentError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    num_positions, vocab = target_probs.shape
    k = draft_tokens.shape[0]
    if num_positions != k + 1:
        raise InvalidArgumentError(
            f"target_probs has {num_positions} rows but {k} draft tokens need k + 1 = {k + 1}"
        )
    if vocab == 0:
        raise InvalidArgumentError("target_probs has an empty vocabulary")
    if draft_tokens.device != target_probs.device:
        raise InvalidArgumentError(
            f"draft_tokens is on {draft_tokens.device}, target_probs on {target_probs.device}"
        )
    if k > 0 and not bool(((draft_tokens >= 0) & (draft_tokens < vocab)).all()):
        raise InvalidArgumentError(
            f"draft token ids must lie in [0, {vocab}), got {draft_tokens.tolist()}"
        )
    if not _rows_are_distributions(target_probs):
        raise InvalidArgumentError(
            "target_probs must be finite and >= 0, with positive mass in every row"
        )
    if draft_probs is None:
        return
    if (
        not isinstance(draft_probs, Tensor)
        or draft_probs.dim() != 2
        or not draft_probs.is_floating_point()
    ):
        raise InvalidArgumentError("draft_probs must be None or a 2-D floating tensor [k, vocab]")
    if tuple(draft_probs.shape) != (k, vocab):
        raise InvalidArgumentError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected (k, vocab) = {(k, vocab)}"
        )
    if draft_probs.device != target_probs.device:
        raise InvalidArgumentError(
            f"draft_probs is on {draft_probs.device}, target_probs on {target_probs.device}"
        )
    if k > 0 and not _rows_are_distributions(draft_probs):
        raise InvalidArgumentError(
            "draft_probs must be finite and >= 0, with positive mass in every row"
        )


def rejection_sample(
    target_probs: Tensor,  # [k + 1, vocab]
    draft_tokens: Tensor,  # [k] int64
    draft_probs: Tensor | None,  # [k, vocab]; None: one-hot q (deterministic drafter)
    generator: torch.Generator | None,
) -> tuple[Tensor, int]:
    """Verify k draft tokens against the target; return (output tokens, num_accepted).

    `target_probs[i]` is p_i, the target's distribution at draft position i, and
    `target_probs[k]` is p at the bonus position, all after temperature / top-k / top-p
    (one-hot rows for a greedy target). `draft_probs[i]` is the q that draft token i was
    sampled from; None means the drafter chose deterministically, so q is one-hot at each
    draft token. A drafter that sent a sparse (truncated) q is expanded by the caller with
    `cluster.runtime.sparse_distribution.to_dense` first: this function takes dense rows
    only, so there is one code path and the residual max(0, p - q) is a plain vector
    difference. p and q are compared in float32 whatever their dtype.

    Draft token i is accepted iff `u[i] < p_i(x_i) / q_i(x_i)`, so p = 0 is always rejected and
    p >= q always accepted. At the first rejection the recovered token is sampled from
    norm(max(0, p_i - q_i)); if all k are accepted the bonus token is sampled from p_k. The
    draws follow the module's random-draw protocol; `generator` must live on the tensors'
    device (None: torch's default generator there).

    Returns a 1-D int64 tensor of the num_accepted + 1 output tokens (accepted draft tokens,
    then the recovered or bonus token) and num_accepted as a Python int.

    Raises InvalidArgumentError on wrong ranks, dtypes, shapes or devices, token ids outside
    the vocabulary, non-finite or negative probabilities, a target row with no mass, and a
    draft token that q gives probability 0 (the drafter could not have sampled it).
    """
    _check_inputs(target_probs, draft_tokens, draft_probs)
    k = draft_tokens.shape[0]
    vocab = target_probs.shape[1]
    device = target_probs.device
    p = target_probs.to(torch.float32)  # [k + 1, vocab]
    q = None if draft_probs is None else draft_probs.to(torch.float32)  # [k, vocab]

    num_accepted = 0
    if k > 0:
        draft_column = draft_tokens.unsqueeze(1)  # [k, 1]
        p_of_draft = p[:k].gather(1, draft_column).squeeze(1)  # [k]
        if q is None:
            q_of_draft = torch.ones(k, dtype=torch.float32, device=device)
        else:
            q_of_draft = q.gather(1, draft_column).squeeze(1)
            if bool((q_of_draft <= 0).any()):
                bad = int(torch.nonzero(q_of_draft <= 0)[0, 0])
                raise InvalidArgumentError(
                    f"draft token {int(draft_tokens[bad])} at position {bad} has probability 0 "
                    "under draft_probs, so the drafter could not have sampled it"
                )
        u = torch.rand(k, generator=generator, device=device)  # [k]
        accepted = u < p_of_draft / q_of_draft  # [k]
        # Accepted positions up to the first rejection: a running product of the flags.
        num_accepted = int(torch.cumprod(accepted.to(torch.int64), dim=0).sum())

    if num_accepted == k:
        row = p[k]  # bonus position
    else:
        p_row = p[num_accepted]
        if q is None:
            q_row = torch.zeros(vocab, dtype=torch.float32, device=device)
            q_row[draft_tokens[num_accepted]] = 1.0
        else:
            q_row = q[num_accepted]
        row = (p_row - q_row).clamp(min=0.0)
        if not bool(row.sum() > 0):
            # max(0, p - q) is all zero only if p <= q everywhere; a rejection then happens
            # with probability sum(q) - sum(p), which is rounding error when both rows are
            # distributions (p == q numerically). Whatever is emitted in that event moves the
            # output distribution by no more than that, and sampling from p keeps the token
            # inside the target's support (a greedy or truncated target never emits a token
            # it excluded).
            row = p_row
    next_token = torch.multinomial(row, 1, generator=generator)  # [1]
    return torch.cat([draft_tokens[:num_accepted], next_token]), num_accepted


def greedy_accept(
    draft_tokens: Sequence[int], targets: Sequence[int], defer_bonus: bool = False
) -> tuple[int, tuple[int, ...], int | None]:
    """The greedy rule on argmaxes alone: `targets[i]` is the target's argmax after the block's
    first i tokens (k + 1 of them). Keeps the longest prefix of `draft_tokens` that matches,
    then emits the target's token there. Returns (accepted count, tokens, deferred): with
    `defer_bonus` and all k > 0 drafts accepted, no bonus is emitted and `deferred` is the
    bonus position's argmax (the next block's stored row); otherwise `deferred` is None.
    Exactly what `rejection_sample` gives one-hot rows, without building them."""
    if len(targets) != len(draft_tokens) + 1:
        raise InvalidArgumentError(
            f"need {len(draft_tokens) + 1} target tokens for {len(draft_tokens)} drafts, "
            f"got {len(targets)}"
        )
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == targets[n]:
        n += 1
    if defer_bonus and 0 < len(draft_tokens) == n:
        return n, tuple(draft_tokens), targets[n]
    return n, (*draft_tokens[:n], targets[n]), None
