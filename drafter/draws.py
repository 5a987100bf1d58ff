"""How a drafted token is drawn from the draft's logits, batched over an engine step.

A task yields `Batched(seed_exact_step, row)` or `Batched(sample_step, row)` with one
`DraftRow`; the engine hands every row of a step that yields the same handler to one call, so
the distributions of all those rows come from one `logits_to_probs_rows` pass. A session's
block (`drafter.drafter`) and a pre-drafted branch (`drafter.branches`) draw with the same
handlers, so a branch drafts what the session would have drafted from the same state.

- Seed-exact rows: the Gumbel-max draw keyed by (seed, position) (`cluster.runtime.gumbel`),
  no q (the verifier accepts by equality).
- Sampled rows: the row's q (the draft's distribution under the row's settings, damped by
  `cluster.runtime.saguaro` where the row says so), one token drawn from it with the row's own
  generator, and q kept sparse to be reported: the rejection rule needs the q really used.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from cluster.runtime.gumbel import gumbel_tokens
from cluster.runtime.saguaro import saguaro_probs
from cluster.runtime.sampling import logits_to_probs_rows
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution, to_sparse
from cluster.runtime.task import each_alone_if_refused
from cluster.runtime.token_choice import sample_rows


@dataclass(frozen=True)
class DraftRow:
    """One drafting task's next-token logits in a step, and how it draws."""

    logits: torch.Tensor  # [1, vocab]
    sampling: SamplingParams
    generator: torch.Generator | None = None
    """Sampled rows: the generator the token is drawn with."""
    key: tuple[int, int] | None = None
    """Seed-exact rows: the request's seed and the drafted token's position."""
    saguaro: tuple[float, int] | None = None
    """Sampled rows: draw from q damped by (scale, top) (`saguaro_probs`); None: from q."""


def seed_exact_step(batch: list[DraftRow]) -> list[int | Exception]:
    """Every seed-exact row of a step: its q as used from one `logits_to_probs_rows` call, its
    token the Gumbel-max draw keyed by (seed, position) from one `gumbel_tokens` call; only the
    rows whose logits the calls refuse fail (`each_alone_if_refused`)."""
    return each_alone_if_refused(_seed_exact_tokens, batch)


def _seed_exact_tokens(batch: list[DraftRow]) -> list[int]:
    probs = logits_to_probs_rows(
        torch.cat([row.logits for row in batch]), [row.sampling for row in batch]
    )
    keys = [row.key for row in batch if row.key is not None]
    return list(gumbel_tokens(probs, [k[0] for k in keys], [k[1] for k in keys]))


def sample_step(batch: list[DraftRow]) -> list[tuple[int, SparseDistribution] | Exception]:
    """Every sampled row of a step: its q as used from one `logits_to_probs_rows` call (each row
    under its own settings, then damped where it asks), its token drawn with its own
    generator, and q kept sparse; only the rows whose logits the call refuses fail
    (`each_alone_if_refused`)."""
    return each_alone_if_refused(_sampled_tokens, batch)


def _sampled_tokens(batch: list[DraftRow]) -> list[tuple[int, SparseDistribution]]:
    probs = logits_to_probs_rows(
        torch.cat([row.logits for row in batch]), [row.sampling for row in batch]
    )
    damped: defaultdict[tuple[float, int], list[int]] = defaultdict(list)
    for index, row in enumerate(batch):
        if row.saguaro is not None:
            damped[row.saguaro].append(index)
    for (scale, top), indices in damped.items():
        rows = torch.tensor(indices, device=probs.device)
        probs.index_copy_(0, rows, saguaro_probs(probs.index_select(0, rows), scale, top))
    tokens = sample_rows(probs, [row.generator for row in batch])
    return [(token, to_sparse(q)) for token, q in zip(tokens, probs, strict=True)]
