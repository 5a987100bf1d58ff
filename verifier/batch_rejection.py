"""Lossless acceptance for a ragged batch of sessions in one call: the batching engine's step.

Contract: a pure function of tensors and explicit per-session `torch.Generator`s; no model, no
I/O. Each session gets exactly what `verifier.rejection.rejection_sample` gives it alone (same
accepted count, same tokens, bit for bit; a sampled session's generator ends in the same state),
then `Verifier.verify`'s deferral: a session's draws come from its own generator in the
single-session order, `torch.rand(k)` then one `torch.multinomial` on the same row, so a request
gives the same tokens alone or batched and never depends on its neighbours.

Layout, flattened in session order
    target_rows   [R, vocab]: session i's rows for its positions 0..k_i; a session that brings
                  a `stored_row` (its bonus was deferred last block) has no row for position 0,
                  which is the stored row, so R = sum(k_i + 1) - (number of stored rows). A
                  sampled session's rows are p as actually used (`logits_to_probs` output);
                  a greedy session's rows are its logits or its one-hot p: only the argmax is
                  read, so nobody builds one-hot rows for it. Turning logits into p stays in
                  `cluster.runtime.sampling`, the one place that does it.
    draft_tokens  [K] int64, K = sum(k_i).

What is vectorised: one argmax per run of consecutive greedy sessions; one gather of p(x) and
of q(x) for all sampled draft positions (a sparse q is matched entry-wise); one acceptance test
and one segmented first-rejection for every session; the residual max(0, p - q), on the rows'
device, only for the first rejected row of each rejected sampled session, all together, where
a one-hot or sparse q is applied entry-wise and never expanded to a dense row. Per session:
`torch.rand` and `torch.multinomial`, as a draw must come from the session's own generator (on
a CPU the multinomial, an exponential draw per vocabulary entry, dominates a sampled batch).
Host syncs: validation, accepted counts, the residuals' mass, tokens, and one per deferred
sampled row to compact it.

Greedy sessions draw nothing: their tokens are fixed whatever the draws (p one-hot: p(x) = 1
always passes, p(x) = 0 always fails, the residual is the argmax), and their q is not read. The
single-session path draws anyway; the difference only leaves a generator that a greedy session
never reads untouched. A deferred sampled bonus is drawn and dropped, as `Verifier.verify` does,
to keep the generator in step.

Split by role: `verifier.batch_inputs` holds the input types (`BatchSession`, `DeferredRow`,
re-exported here) and every check; `verifier.batch_layout` where each session lies and the
gathers of p(x), q(x) and greedy targets; this module the draws, acceptance and residuals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cluster.runtime.sparse_distribution import SparseDistribution
from verifier.batch_inputs import BatchSession, DeferredRow, SparseQ
from verifier.batch_layout import Batch

__all__ = ["BatchSession", "DeferredRow", "SessionOutcome", "batch_rejection_sample"]

_SPARSE_ENTRY_BYTES = 12  # an int64 id and a float32 probability, against 4 bytes dense


@dataclass(frozen=True)
class SessionOutcome:
    """What one session's block became."""

    num_accepted: int
    tokens: tuple[int, ...]
    """Accepted draft tokens, then the recovered or bonus token; no bonus when deferred."""
    deferred_row: DeferredRow | None = None
    """Set iff the bonus was deferred: the next block's `stored_row`."""


def batch_rejection_sample(
    target_rows: Tensor,  # [R, vocab]: see the module docstring for the layout
    draft_tokens: Tensor,  # [K] int64
    sessions: Sequence[BatchSession],
) -> list[SessionOutcome]:
    """Verify every session's draft block at once; one `SessionOutcome` per session, in order.

    The rule and the draw protocol are `verifier.rejection.rejection_sample`'s, session by
    session; with `defer_bonus` and all k > 0 tokens accepted the bonus is drawn and dropped
    and p_k comes back as `deferred_row`, as `Verifier.verify` keeps it. Raises
    InvalidArgumentError, naming the session, on what `rejection_sample` or `to_dense` would
    refuse, on a layout that does not add up, and on a missing or shared generator; it raises
    before any draw, so a refused batch leaves every generator as it was.
    """
    batch = Batch(target_rows, draft_tokens, sessions)
    targets, target_index = batch.greedy_targets()
    p, q, sparse = batch.draft_probabilities()
    batch.checks.raise_first_failure()
    num_accepted = _num_accepted(batch, targets, target_index, p, q)

    # Greedy: the target at the first rejected position (or k). Sampled: one draw each from its
    # own generator, the residual rows of the rejected ones built together.
    greedy_next = targets[batch.tensor([target_index[i][num_accepted[i]] for i in batch.greedy])]
    rejected = [
        (i, num_accepted[i]) for i in batch.sampled if num_accepted[i] < sessions[i].num_draft
    ]
    residual = _residual_rows(batch, rejected, sparse) if rejected else None
    residual_of = {i: row for row, (i, _) in enumerate(rejected)}
    sampled_next: list[Tensor] = []
    deferred: dict[int, DeferredRow] = {}
    for i in batch.sampled:
        s, n = sessions[i], num_accepted[i]
        row = (
            batch.p_row(i, n)
            if residual is None or i not in residual_of
            else residual[residual_of[i]]
        )
        sampled_next.append(torch.multinomial(row, 1, generator=s.generator))
        if s.defer_bonus and 0 < s.num_draft == n:
            deferred[i] = _compact(row)
    flat = torch.cat([draft_tokens, greedy_next, *sampled_next]).tolist()  # the token sync
    next_token = dict(zip(batch.greedy + batch.sampled, flat[draft_tokens.shape[0] :], strict=True))
    outcomes = []
    for i, (s, n, d0) in enumerate(zip(sessions, num_accepted, batch.draft_start, strict=True)):
        if s.defer_bonus and 0 < s.num_draft == n:
            row_kept = next_token[i] if s.greedy else deferred[i]
            outcomes.append(SessionOutcome(n, tuple(flat[d0 : d0 + n]), row_kept))
        else:
            outcomes.append(SessionOutcome(n, (*flat[d0 : d0 + n], next_token[i])))
    return outcomes


def _num_accepted(
    batch: Batch, targets: Tensor, target_index: dict[int, list[int]], p: Tensor, q: Tensor
) -> list[int]:
    """Draws each sampled session's uniforms, tests every position, and returns each
    session's accepted prefix length: its first rejected position, or k (one sync)."""
    if batch.draft.numel() == 0:
        return [0] * len(batch.sessions)
    accepted = torch.zeros_like(batch.draft, dtype=torch.bool)
    if batch.sampled_m:
        # The single-session path draws nothing when k = 0; neither does this.
        u = torch.cat(
            [
                torch.rand(s.num_draft, generator=s.generator, device=batch.device)
                for s in (batch.sessions[i] for i in batch.sampled)
                if s.num_draft
            ]
        )
        accepted[batch.tensor(batch.sampled_m)] = u < p / q
    greedy_m = [m for i in batch.greedy for m in batch.positions(i)]
    if greedy_m:
        greedy_t = [t for i in batch.greedy for t in target_index[i][: batch.sessions[i].num_draft]]
        m = batch.tensor(greedy_m)
        accepted[m] = batch.draft[m] == targets[batch.tensor(greedy_t)]
    k = batch.tensor([s.num_draft for s in batch.sessions])
    owner = batch.tensor([i for i, s in enumerate(batch.sessions) for _ in range(s.num_draft)])
    position = batch.tensor([j for s in batch.sessions for j in range(s.num_draft)])
    first_rejected = torch.where(accepted, k[owner], position)
    counts: list[int] = k.scatter_reduce(0, owner, first_rejected, reduce="amin").tolist()
    return counts


def _residual_rows(batch: Batch, rejected: list[tuple[int, int]], sparse: SparseQ | None) -> Tensor:
    """max(0, p - q) at each (session, first rejected position), or p where that is all
    zero (`verifier.rejection` says why), `[rejected, vocab]` float32. It differs from p
    only where q > 0, so a one-hot or sparse q is applied entry-wise to a copy of p and
    never expanded; a dense q row is subtracted whole. Bit for bit the dense computation:
    the same float32 subtraction and clamp wherever q > 0, and p - 0 = p elsewhere."""
    residual = torch.stack([batch.p_row(i, n) for i, n in rejected])  # a copy of each p
    entry_rows: list[Tensor] = []  # (row, token id, q) of every one-hot and sparse entry
    entry_ids: list[Tensor] = []
    entry_q: list[Tensor] = []
    one_hot_rows: list[int] = []
    one_hot_m: list[int] = []
    row_of_slot = torch.full((len(batch.sampled_m),), -1, device=batch.device)
    for row, (i, n) in enumerate(rejected):
        draft_probs = batch.sessions[i].draft_probs
        if draft_probs is None:
            one_hot_rows.append(row)
            one_hot_m.append(batch.draft_start[i] + n)
        elif isinstance(draft_probs, Tensor):
            residual[row].sub_(draft_probs[n].to(torch.float32)).clamp_(min=0.0)
        else:
            row_of_slot[batch.slot_start[batch.sampled.index(i)] + n] = row
    if one_hot_rows:
        entry_rows.append(batch.tensor(one_hot_rows))
        entry_ids.append(batch.draft[batch.tensor(one_hot_m)])
        entry_q.append(torch.ones(len(one_hot_rows), device=batch.device))
    if sparse is not None:
        entry_row = row_of_slot[sparse.slots]
        keep = entry_row >= 0
        entry_rows.append(entry_row[keep])
        entry_ids.append(sparse.token_ids[keep])
        entry_q.append(sparse.probs[keep])
    if entry_rows:
        rows, ids = torch.cat(entry_rows), torch.cat(entry_ids)
        residual[rows, ids] = (residual[rows, ids] - torch.cat(entry_q)).clamp(min=0.0)
    for row in torch.nonzero(residual.sum(dim=-1) <= 0).flatten().tolist():
        residual[row] = batch.p_row(*rejected[row])  # rounding only: p <= q everywhere
    return residual


def _compact(row: Tensor) -> DeferredRow:  # row: float32 [vocab]
    """The smaller exact form of a p row: its nonzero entries, or a dense copy of its own."""
    token_ids = torch.nonzero(row).flatten()
    if token_ids.numel() * _SPARSE_ENTRY_BYTES < row.numel() * row.element_size():
        return SparseDistribution(token_ids=token_ids, probs=row[token_ids])
    return row.clone()
