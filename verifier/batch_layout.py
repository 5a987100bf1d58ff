"""Where each session of a ragged batch lies, and the gathers that read it, for
`verifier.batch_rejection`.

Contract: `Batch` takes one call's `target_rows`, `draft_tokens` and sessions (layout in
`verifier.batch_rejection`'s docstring), checks the layout on the host at once, and queues
every value check in `Batch.checks` while it gathers: the greedy sessions' argmax targets, and
p(x) and q(x) at every sampled draft position, in one gather or match each across the batch.
It draws nothing and reads no generator; whoever uses it calls `checks.raise_first_failure()`
before any draw. Tensors stay on `target_rows`' device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.runtime.token_choice import argmax_rows
from verifier.batch_inputs import (
    BatchSession,
    Checks,
    DeferredRow,
    SparseQ,
    check_layout,
    check_sparse,
    first,
    is_distribution,
    owner,
    problem_of,
)


class Batch:
    """One call's inputs and their host-side layout: where each session's rows, draft tokens
    and sampled draft positions ("slots": sampled sessions' positions, in order) lie."""

    def __init__(
        self, target_rows: Tensor, draft_tokens: Tensor, sessions: Sequence[BatchSession]
    ) -> None:
        self.row_start, self.draft_start = check_layout(target_rows, draft_tokens, sessions)
        self.rows, self.draft, self.sessions = target_rows, draft_tokens, sessions
        self.device, self.vocab = target_rows.device, target_rows.shape[1]
        self.checks = Checks()
        self.greedy = [i for i, s in enumerate(sessions) if s.greedy]
        self.sampled = [i for i, s in enumerate(sessions) if not s.greedy]
        self.slot_start = [0]  # first slot of each sampled session, then the total
        for i in self.sampled:
            self.slot_start.append(self.slot_start[-1] + sessions[i].num_draft)
        self.sampled_m = [m for i in self.sampled for m in self.positions(i)]
        in_vocab = (draft_tokens >= 0) & (draft_tokens < self.vocab)
        self.checks.expect(
            in_vocab,
            lambda: self.at_position(first(~in_vocab), f"is not a token id in [0, {self.vocab})"),
        )
        self.safe_draft = draft_tokens.clamp(0, self.vocab - 1)  # in bounds until checks land

    def tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def positions(self, i: int) -> range:
        return range(self.draft_start[i], self.draft_start[i] + self.sessions[i].num_draft)

    def at_position(self, m: int, problem: str) -> str:
        i = owner(self.draft_start, m)
        j = m - self.draft_start[i]
        return f"session {i}: draft token {int(self.draft[m])} at position {j} {problem}"

    def runs(self, greedy: bool) -> list[tuple[int, int]]:
        """[start, stop) ranges of target rows of consecutive greedy (or sampled) sessions."""
        runs: list[tuple[int, int]] = []
        for start, s in zip(self.row_start, self.sessions, strict=True):
            if s.greedy == greedy and s.num_rows:
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + s.num_rows)
                else:
                    runs.append((start, start + s.num_rows))
        return runs

    def expect_rows(self, first_row: int, ok: Tensor, problem: str) -> None:
        self.checks.expect(
            ok,
            lambda: f"session {owner(self.row_start, first_row + first(~ok))}: {problem}",
        )

    def bad_distribution(self, start: int, stop: int) -> Callable[[], str]:
        def message() -> str:  # which session of the run: recomputed, on the error path only
            for i in range(owner(self.row_start, start), owner(self.row_start, stop - 1) + 1):
                rows = self.rows[self.row_start[i] : self.row_start[i] + self.sessions[i].num_rows]
                if rows.numel() and not bool(is_distribution(rows)):
                    return f"session {i}: target rows must be distributions"
            raise AssertionError("no session of the run failed the check")

        return message

    def greedy_targets(self) -> tuple[Tensor, dict[int, list[int]]]:
        """Argmax of every greedy row (one call per run), then the stored ones; and for each
        greedy session the index there of its target at positions 0..k."""
        parts = []
        for start, stop in self.runs(greedy=True):
            rows = self.rows[start:stop]
            best = argmax_rows(rows)  # ties: the lowest id, as `logits_to_probs` breaks them
            # argmax picks a NaN if there is one; a finite top also rules out +inf, all -inf.
            top = rows.gather(1, best[:, None]).squeeze(1)
            self.expect_rows(start, torch.isfinite(top), "a greedy row has NaN, +inf or no max")
            parts.append(best)
        num_rows = sum(self.sessions[i].num_rows for i in self.greedy)
        index: dict[int, list[int]] = {}
        stored: list[int] = []
        seen = 0
        for i in self.greedy:
            s = self.sessions[i]
            index[i] = list(range(seen, seen + s.num_rows))
            seen += s.num_rows
            if isinstance(s.stored_row, int):
                index[i].insert(0, num_rows + len(stored))
                stored.append(s.stored_row)
        return torch.cat([*parts, self.tensor(stored)]), index

    def draft_probabilities(self) -> tuple[Tensor, Tensor, SparseQ | None]:
        """p(x) and q(x) at every slot, float32 `[slots]`; queues the validity checks."""
        for start, stop in self.runs(greedy=False):
            self.checks.expect(
                is_distribution(self.rows[start:stop]), self.bad_distribution(start, stop)
            )
        x = self.safe_draft[self.tensor(self.sampled_m)]  # [slots]
        p = self.p_of_draft(x)
        q, sparse = self.q_of_draft(x)
        if self.sampled_m:
            drawable = q > 0
            self.checks.expect(
                drawable,
                lambda: self.at_position(
                    self.sampled_m[first(~drawable)],
                    "has probability 0 under draft_probs: the drafter could not have sampled it",
                ),
            )
        return p, q, sparse

    def p_of_draft(self, x: Tensor) -> Tensor:  # x: [slots] -> [slots]
        """One gather from `target_rows`, plus the stored rows' p at position 0."""
        slots: list[int] = []
        rows: list[int] = []
        stored_slots: list[int] = []
        stored_p: list[Tensor] = []
        for i, slot in zip(self.sampled, self.slot_start, strict=False):
            s, first_row = self.sessions[i], self.row_start[i]
            skip = s.stored_row is not None  # position 0 is the stored row
            if skip and s.num_draft:
                stored_slots.append(slot)
                stored_p.append(_stored_probability(s.stored_row, x[slot]))
            slots.extend(range(slot + skip, slot + s.num_draft))
            rows.extend(range(first_row, first_row + s.num_draft - skip))
        p = torch.zeros(len(self.sampled_m), dtype=torch.float32, device=self.device)
        if slots:
            at = self.tensor(slots)
            p[at] = self.rows[self.tensor(rows), x[at]].to(torch.float32)
        if stored_slots:
            p[self.tensor(stored_slots)] = torch.stack(stored_p)
        return p

    def q_of_draft(self, x: Tensor) -> tuple[Tensor, SparseQ | None]:  # x: [slots]
        """q(x) at every slot: 1 for one-hot q, a gather per dense q, and for sparse q one
        entry-wise match over all of them; with the sparse entries, flat on the device."""
        q = torch.ones(len(self.sampled_m), dtype=torch.float32, device=self.device)
        dense_slots: list[int] = []
        dense_q: list[Tensor] = []
        sparse_slots: list[int] = []
        entry_slots: list[int] = []
        ids: list[Tensor] = []
        probs: list[Tensor] = []
        for i, slot in zip(self.sampled, self.slot_start, strict=False):
            k, draft_probs = self.sessions[i].num_draft, self.sessions[i].draft_probs
            if isinstance(draft_probs, Tensor) and k:
                self.checks.expect(
                    is_distribution(draft_probs),
                    problem_of(i, "draft_probs rows must be distributions"),
                )
                dense_slots.extend(range(slot, slot + k))
                dense_q.append(draft_probs.gather(1, x[slot : slot + k, None]).squeeze(1))
            elif draft_probs is not None and not isinstance(draft_probs, Tensor):
                sparse_slots.extend(range(slot, slot + k))
                for j, row in enumerate(draft_probs):
                    ids.append(row.token_ids)
                    probs.append(row.probs)
                    entry_slots.extend([slot + j] * row.token_ids.numel())
        if dense_slots:
            q[self.tensor(dense_slots)] = torch.cat(dense_q).to(torch.float32)
        if not ids:
            return q, None
        sparse = SparseQ(_cat(ids, self.device), _cat(probs, self.device), self.tensor(entry_slots))
        check_sparse(
            self.checks,
            sparse,
            sparse_slots,
            len(self.sampled_m),
            self.vocab,
            lambda slot, problem: self.at_position(self.sampled_m[slot], problem),
        )
        # Ids are unique within a row (checked), so a slot matches one entry at most.
        match = sparse.token_ids == x[sparse.slots]
        q[self.tensor(sparse_slots)] = 0.0
        q[sparse.slots[match]] = sparse.probs[match]
        return q, sparse

    def p_row(self, i: int, position: int) -> Tensor:
        """A sampled session's p at `position`, float32 `[vocab]` (a view where it can be)."""
        s = self.sessions[i]
        if s.stored_row is None or position > 0:
            return self.rows[self.row_start[i] + position - (s.stored_row is not None)].to(
                torch.float32
            )
        if isinstance(s.stored_row, SparseDistribution):
            dense = torch.zeros(self.vocab, dtype=torch.float32, device=self.device)
            dense[s.stored_row.token_ids.to(self.device)] = s.stored_row.probs.to(self.device)
            return dense
        assert isinstance(s.stored_row, Tensor)  # BatchSession: sampled sessions store p rows
        return s.stored_row.to(torch.float32)


def _stored_probability(stored: DeferredRow | None, token: Tensor) -> Tensor:
    """p(x) under a sampled session's stored row, a 0-d float32 tensor on `token`'s device."""
    if isinstance(stored, SparseDistribution):
        ids, probs = stored.token_ids.to(token.device), stored.probs.to(token.device)
        return torch.where(ids == token, probs, 0.0).sum()  # one match at most: exact
    assert isinstance(stored, Tensor)
    return stored[token].to(torch.float32)


def _cat(parts: list[Tensor], device: torch.device) -> Tensor:
    """Concatenate where the parts live (rows from the wire are on the CPU), then move once."""
    return torch.cat([part.to(parts[0].device) for part in parts]).to(device)
