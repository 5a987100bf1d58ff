"""A truncated distribution as a drafter sends it: `SparseDistribution`, and the dense rows it
stands for.

Contract: pure functions of tensors, no I/O. A `SparseDistribution` holds 1-D int64 ids and
float32 probabilities of one length (checked when built); every other token has probability
0, and nothing is renormalised. `to_sparse` keeps a row's nonzero entries, in ascending id
order; `to_dense` rebuilds the exact q a drafter sampled from, refusing a row that is empty,
repeats an id, has an id outside the vocabulary or a probability not finite and >= 0
(`InvalidArgumentError`): the wire leaves these checks to the replica (docs/architecture.md,
invariant 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution over exactly `token_ids`; every other token has probability 0.

    This is how a drafter that truncated its q (top-k / top-p) sends it: the entries it could
    have sampled, with the probabilities it sampled them with. Nothing is renormalised.
    """

    token_ids: Tensor  # [s] int64
    probs: Tensor  # [s] float32

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, Tensor) or not isinstance(self.probs, Tensor):
            raise InvalidArgumentError("SparseDistribution needs tensors for token_ids and probs")
        if self.token_ids.dim() != 1 or self.token_ids.dtype != torch.int64:
            raise InvalidArgumentError(
                "SparseDistribution.token_ids must be a 1-D int64 tensor, got "
                f"{self.token_ids.dtype} {tuple(self.token_ids.shape)}"
            )
        if self.probs.dim() != 1 or self.probs.dtype != torch.float32:
            raise InvalidArgumentError(
                "SparseDistribution.probs must be a 1-D float32 tensor, got "
                f"{self.probs.dtype} {tuple(self.probs.shape)}"
            )
        if self.token_ids.shape != self.probs.shape:
            raise InvalidArgumentError(
                f"SparseDistribution has {self.token_ids.numel()} token ids but "
                f"{self.probs.numel()} probabilities"
            )


def to_sparse(probs_row: Tensor) -> SparseDistribution:  # probs_row: [vocab]
    """Keep the nonzero entries of one distribution row, in ascending token id order."""
    if not isinstance(probs_row, Tensor) or probs_row.dim() != 1:
        raise InvalidArgumentError("to_sparse takes one 1-D distribution row [vocab]")
    token_ids = torch.nonzero(probs_row).flatten()
    return SparseDistribution(token_ids=token_ids, probs=probs_row[token_ids].to(torch.float32))


def to_dense(rows: Sequence[SparseDistribution], vocab_size: int) -> Tensor:
    """Expand sparse rows into a dense float32 `[len(rows), vocab_size]` tensor.

    Entries are placed exactly as sent; nothing is renormalised, because the drafter sent the
    exact q it sampled from (docs/architecture.md, invariant 1).
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise InvalidArgumentError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    dense = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    for index, row in enumerate(rows):
        ids, probs = row.token_ids, row.probs
        if ids.numel() == 0:
            raise InvalidArgumentError(f"sparse row {index} is empty: a distribution needs mass")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise InvalidArgumentError(
                f"sparse row {index} has token ids outside [0, {vocab_size}): "
                f"min {int(ids.min())}, max {int(ids.max())}"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise InvalidArgumentError(f"sparse row {index} repeats a token id")
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise InvalidArgumentError(f"sparse row {index} has probabilities not finite and >= 0")
        dense[index, ids.cpu()] = probs.cpu()
    return dense
