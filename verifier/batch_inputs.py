"""A ragged batch's inputs and every check on them, for `verifier.batch_rejection`.

Contract: `BatchSession` (one session's part of a batch) and `DeferredRow` (a p row kept across
blocks) are the public input types, re-exported by `verifier.batch_rejection`; the rest is that
engine's internals. Every refusal is an `InvalidArgumentError` naming the session and what is
wrong: `BatchSession` checks its own fields when built; `check_layout` checks on the host that
the tensors and sessions add up; `Checks` gathers the checks that need the values, computed on
the device and read back in one sync before any draw, so a refused batch leaves every generator
untouched. Pure tensors: no model, no I/O, no draws.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sparse_distribution import SparseDistribution

DeferredRow = int | SparseDistribution | Tensor
"""p at the position after a fully accepted block whose bonus was deferred, stored exactly and
compactly: the argmax for a greedy session (p is one-hot there); the nonzero entries when p is
truncated enough that they are smaller than the row; else a dense float32 `[vocab]` copy that
owns its memory (never a view pinning the batch's rows)."""


@dataclass(frozen=True)
class BatchSession:
    """One session's part of the batch; its tensors live on `target_rows`' device."""

    num_draft: int
    """k, the number of draft tokens (0: plain target decoding)."""
    greedy: bool
    """The target samples by argmax (temperature 0)."""
    generator: torch.Generator | None = None
    """The session's own seeded generator; required and unshared when not greedy."""
    draft_probs: Tensor | Sequence[SparseDistribution] | None = None
    """q per draft token: dense `[k, vocab]`, k sparse rows, or None (one-hot: deterministic)."""
    defer_bonus: bool = False
    """When all k > 0 tokens pass, emit no bonus and return `deferred_row` instead."""
    stored_row: DeferredRow | None = None
    """The `deferred_row` of this session's previous block: p at position 0, taken as this
    module returned it (its shape and range are checked, its values are not)."""

    def __post_init__(self) -> None:
        k = self.num_draft
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidArgumentError(f"num_draft must be an int >= 0, got {k!r}")
        if not self.greedy and not isinstance(self.generator, torch.Generator):
            raise InvalidArgumentError("a sampled session needs its own torch.Generator")
        q = self.draft_probs
        if isinstance(q, Tensor):
            if q.dim() != 2 or not q.is_floating_point() or q.shape[0] != k:
                raise InvalidArgumentError(f"dense draft_probs must be a float [k={k}, vocab]")
        elif q is not None and (
            not isinstance(q, list | tuple)
            or len(q) != k
            or not all(isinstance(row, SparseDistribution) and row.probs.numel() for row in q)
        ):
            raise InvalidArgumentError(f"sparse draft_probs must be {k} non-empty rows")
        row = self.stored_row
        if self.greedy and row is not None and (not isinstance(row, int) or isinstance(row, bool)):
            raise InvalidArgumentError("a greedy session's stored_row is its argmax token id")
        if not self.greedy and row is not None and not isinstance(row, Tensor | SparseDistribution):
            raise InvalidArgumentError("a sampled session's stored_row is a p row, dense or sparse")

    @property
    def num_rows(self) -> int:
        """How many of `target_rows` belong to this session."""
        return self.num_draft + (self.stored_row is None)


class Checks:
    """Validity flags computed on the device and read back in one sync, before any draw, so
    a refused batch leaves every generator untouched."""

    def __init__(self) -> None:
        self._flags: list[Tensor] = []
        self._messages: list[Callable[[], str]] = []

    def expect(self, ok: Tensor, message: Callable[[], str]) -> None:
        self._flags.append(ok.all())
        self._messages.append(message)

    def raise_first_failure(self) -> None:
        if self._flags:
            flags = torch.stack(self._flags).tolist()
            for ok, message in zip(flags, self._messages, strict=True):
                if not ok:
                    raise InvalidArgumentError(message())


@dataclass(frozen=True)
class SparseQ:
    """Every sampled session's sparse q entries, flat on the device."""

    token_ids: Tensor  # [e] int64
    probs: Tensor  # [e] float32
    slots: Tensor  # [e] int64: the slot (see `batch_layout.Batch`) of each entry


def owner(starts: list[int], index: int) -> int:
    """Which of the spans beginning at `starts` (ascending) holds `index`; empty spans share
    their start with the next one, and bisect_right skips past them."""
    return bisect.bisect_right(starts, index) - 1


def first(bad: Tensor) -> int:  # first True of a 1-D mask; error paths only
    return int(torch.nonzero(bad)[0, 0])


def check_layout(
    target_rows: Tensor, draft_tokens: Tensor, sessions: Sequence[BatchSession]
) -> tuple[list[int], list[int]]:
    """Host-side checks; returns each session's first flat row and first draft position."""
    if (
        not isinstance(target_rows, Tensor)
        or target_rows.dim() != 2
        or not target_rows.is_floating_point()
        or target_rows.shape[1] == 0
    ):
        raise InvalidArgumentError("target_rows must be a 2-D float tensor [rows, vocab > 0]")
    if not isinstance(draft_tokens, Tensor) or draft_tokens.dim() != 1:
        raise InvalidArgumentError("draft_tokens must be a 1-D tensor [sum of k]")
    if draft_tokens.dtype != torch.int64 or draft_tokens.device != target_rows.device:
        raise InvalidArgumentError(
            f"draft_tokens must be int64 on {target_rows.device}, got "
            f"{draft_tokens.dtype} on {draft_tokens.device}"
        )
    device, vocab = target_rows.device, target_rows.shape[1]
    row_start: list[int] = []
    draft_start: list[int] = []
    num_rows = num_draft = 0
    owners: dict[int, int] = {}  # id(generator) -> session
    for i, s in enumerate(sessions):
        if not isinstance(s, BatchSession):
            raise InvalidArgumentError(f"session {i} is not a BatchSession")
        row_start.append(num_rows)
        draft_start.append(num_draft)
        num_rows += s.num_rows
        num_draft += s.num_draft
        tensors = [s.draft_probs] if isinstance(s.draft_probs, Tensor) else []
        if isinstance(s.stored_row, Tensor):
            tensors.append(s.stored_row)
            if tuple(s.stored_row.shape) != (vocab,) or not s.stored_row.is_floating_point():
                raise InvalidArgumentError(f"session {i}: stored_row must be float [{vocab}]")
        if isinstance(s.draft_probs, Tensor) and s.draft_probs.shape[1] != vocab:
            raise InvalidArgumentError(f"session {i}: draft_probs must have {vocab} columns")
        if any(t.device != device for t in tensors):
            raise InvalidArgumentError(f"session {i}: its tensors must be on {device}")
        if isinstance(s.stored_row, int) and not 0 <= s.stored_row < vocab:
            raise InvalidArgumentError(
                f"session {i}: stored_row {s.stored_row} not in [0, {vocab})"
            )
        if not s.greedy:
            assert s.generator is not None  # BatchSession guarantees it
            if s.generator.device.type != device.type:
                raise InvalidArgumentError(f"session {i}: its generator must be on {device}")
            if id(s.generator) in owners:
                raise InvalidArgumentError(
                    f"sessions {owners[id(s.generator)]} and {i} share a generator: each "
                    "session's draws must come from its own"
                )
            owners[id(s.generator)] = i
    if (num_rows, num_draft) != (target_rows.shape[0], draft_tokens.shape[0]):
        raise InvalidArgumentError(
            f"the sessions need {num_rows} target rows (k + 1 each, k with a stored row) and "
            f"{num_draft} draft tokens; got {target_rows.shape[0]} and {draft_tokens.shape[0]}"
        )
    return row_start, draft_start


def check_sparse(
    checks: Checks,
    sparse: SparseQ,
    sparse_slots: list[int],
    num_slots: int,
    vocab: int,
    describe: Callable[[int, str], str],
) -> None:
    """What `to_dense` and `rejection_sample` check of sparse rows, all entries at once;
    `describe(slot, problem)` names the draft position of a slot for the error message."""
    ids, probs, slots = sparse.token_ids, sparse.probs, sparse.slots

    def at(slot: int, problem: str) -> str:
        return describe(slot, f"has a sparse q row that {problem}")

    in_vocab = (ids >= 0) & (ids < vocab)
    checks.expect(in_vocab, lambda: at(int(slots[first(~in_vocab)]), "has bad ids"))
    valid = torch.isfinite(probs) & (probs >= 0)
    checks.expect(valid, lambda: at(int(slots[first(~valid)]), "is not finite, >= 0"))
    keys = (slots * vocab + ids).sort().values
    repeated = keys[1:] == keys[:-1]
    checks.expect(~repeated, lambda: at(int(keys[first(repeated)]) // vocab, "repeats an id"))
    mass = torch.zeros(num_slots, device=slots.device).index_add_(0, slots, probs)
    mass = mass[torch.tensor(sparse_slots, dtype=torch.int64, device=slots.device)]
    has_mass = (mass > 0) & (mass < math.inf)
    checks.expect(has_mass, lambda: at(sparse_slots[first(~has_mass)], "has no (finite) mass"))


def is_distribution(rows: Tensor) -> Tensor:  # [n, vocab] -> 0-d bool
    """`verifier.rejection`'s test: NaN fails every comparison, +inf makes a mass infinite.
    Whole-tensor reductions: a per-row `amin` goes to the CPU thread pool, which stalls."""
    mass = rows.sum(dim=-1)
    return (rows.min() >= 0) & (mass.min() > 0) & (mass.max() < math.inf)


def problem_of(session: int, problem: str) -> Callable[[], str]:
    return lambda: f"session {session}: {problem}"
