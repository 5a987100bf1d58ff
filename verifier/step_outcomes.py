"""A verifier step's outcomes, batched: what each block's rows decide, for every block of a step at
once.

Pure functions of tensors and plain records (no engine, no sessions, no I/O), called by the
verifier's Batched handlers after a step (`verifier.verifier`): every sampled block's p from one
`logits_to_probs_rows` call (each row under its own session's settings) and one
`batch_rejection_sample` call; every seed-exact block's draws from one `gumbel_tokens` call; a
greedy block's outcome from its argmaxes alone. A refused batch changes nothing: only the
blocks at fault then fail (`each_alone_if_refused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.runtime.gumbel import gumbel_tokens
from cluster.runtime.sampling import logits_to_probs_rows
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.runtime.task import each_alone_if_refused
from cluster.runtime.token_choice import greedy_tokens
from verifier.batch_rejection import (
    BatchSession,
    DeferredRow,
    SessionOutcome,
    batch_rejection_sample,
)
from verifier.rejection import greedy_accept


@dataclass(frozen=True)
class Scored:
    """One sampled block waiting for its step's acceptance call, its rows still logits."""

    logits: torch.Tensor
    """The target's logits at the block's positions (`[rows, vocab]`, maybe no rows)."""
    sampling: SamplingParams
    draft_tokens: tuple[int, ...]
    session: BatchSession


@dataclass(frozen=True)
class Acceptance:
    """One block's part of a batched acceptance call."""

    rows: torch.Tensor
    """The target's p for the block, as used (temperature, top-k, top-p applied)."""
    draft_tokens: tuple[int, ...]
    session: BatchSession


@dataclass(frozen=True)
class Keyed:
    """One seed-exact block waiting for its step's draws: its rows' logits and their noise."""

    logits: torch.Tensor  # [rows, vocab]
    sampling: SamplingParams
    seed: int
    first_position: int
    """The sequence position of row 0; row i is `first_position + i`."""


def seed_exact_draws(batch: list[Keyed]) -> list[list[int]]:
    sizes = [item.logits.shape[0] for item in batch]
    probs = logits_to_probs_rows(
        torch.cat([item.logits for item in batch]),
        [item.sampling for item, size in zip(batch, sizes, strict=True) for _ in range(size)],
    )
    seeds = [item.seed for item, size in zip(batch, sizes, strict=True) for _ in range(size)]
    positions = [item.first_position + i for item in batch for i in range(item.logits.shape[0])]
    tokens = gumbel_tokens(probs, seeds, positions)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [tokens[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def probs_by_block(batch: list[Scored]) -> list[torch.Tensor | Exception]:
    """Each block's p as used, from one `logits_to_probs_rows` call over every row; only the
    blocks whose logits it refuses fail (`each_alone_if_refused`)."""
    return each_alone_if_refused(_probs_together, batch)


def _probs_together(batch: list[Scored]) -> list[torch.Tensor]:
    sizes = [item.logits.shape[0] for item in batch]
    together = logits_to_probs_rows(
        torch.cat([item.logits for item in batch]),
        [item.sampling for item, size in zip(batch, sizes, strict=True) for _ in range(size)],
    )
    return list(together.split(sizes))


def accept_together(batch: list[Acceptance]) -> list[SessionOutcome]:
    rows = torch.cat([item.rows for item in batch])
    drafts = [token for item in batch for token in item.draft_tokens]
    draft_tokens = torch.tensor(drafts, dtype=torch.long, device=rows.device)
    return batch_rejection_sample(rows, draft_tokens, [item.session for item in batch])


def greedy_outcome(
    logits: torch.Tensor | None,  # [k + 1 - (stored is not None), vocab]
    stored: DeferredRow | None,
    draft_tokens: tuple[int, ...],
    defer_bonus: bool,
) -> SessionOutcome:
    """A greedy block's outcome from the argmaxes of its rows (and the stored argmax of a
    deferred bonus, which stands for position 0)."""
    targets: list[int] = [] if stored is None else [int(stored)]  # type: ignore[arg-type]
    if logits is not None and logits.shape[0]:
        targets += greedy_tokens(logits)
    num_accepted, tokens, deferred = greedy_accept(draft_tokens, targets, defer_bonus)
    return SessionOutcome(num_accepted, tokens, deferred)


def on_device(
    rows: Sequence[SparseDistribution] | None, device: torch.device
) -> Sequence[SparseDistribution] | None:
    """Sparse q rows on the target's device (they arrive on the host)."""
    if rows is None or device.type == "cpu":
        return rows
    return tuple(
        SparseDistribution(token_ids=r.token_ids.to(device), probs=r.probs.to(device)) for r in rows
    )
