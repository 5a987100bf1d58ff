"""Sampling transforms: logits to the distribution a token is actually drawn from.

Contract: pure functions of tensors and explicit `torch.Generator`s; no I/O, no global random
state. `logits_to_probs` turns logits into the distribution *actually used* after temperature,
top-k and top-p, as float32 rows that sum to 1. The drafter's q and the verifier's p both come
from it, and the rejection rule in `verifier.rejection` is lossless only because it sees those
exact distributions (docs/architecture.md, invariant 1). A drafter that truncates its distribution
sends the surviving entries as a `SparseDistribution`; `to_dense` rebuilds the exact q from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError

NO_TOP_K = 0
"""`SamplingParams.top_k` value that keeps the whole vocabulary."""

NO_TOP_P = 1.0
"""`SamplingParams.top_p` value that makes no nucleus cut."""


def _is_real(value: object) -> bool:
    # bool is an int subclass; `temperature=True` is a bug, not a temperature of 1.
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into a token; validated when built."""

    temperature: float = 0.0
    """Logits are divided by this before the softmax; 0 means greedy (argmax, no randomness)."""

    top_k: int = NO_TOP_K
    """Keep only the `top_k` most probable tokens; 0 means no limit."""

    top_p: float = NO_TOP_P
    """Keep the smallest set of most probable tokens whose mass reaches `top_p`; 1.0: no cut."""

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise InvalidArgumentError(
                f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}"
            )
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0 = no limit), got {self.top_k!r}")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p):
            raise InvalidArgumentError(
                f"top_p must be a finite number with 0 < top_p <= 1, got {self.top_p!r}"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must satisfy 0 < top_p <= 1, got {self.top_p!r}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0


def _check_logits(logits: Tensor) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidArgumentError(
            "logits must be a 2-D floating-point tensor [n, vocab], got "
            + (
                f"{logits.dtype} {tuple(logits.shape)}"
                if isinstance(logits, Tensor)
                else "non-tensor"
            )
        )
    if logits.shape[1] == 0:
        raise InvalidArgumentError("logits must have a vocabulary of at least one token")
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise InvalidArgumentError("logits must not contain NaN or +inf")
    if not bool(torch.isfinite(logits).any(dim=-1).all()):
        raise InvalidArgumentError("every logits row needs at least one finite entry")


def argmax_rows(rows: Tensor) -> Tensor:  # rows: [n, vocab] -> int64 [n]
    """Each row's argmax: the lowest index on ties, a NaN if there is one (as `torch.argmax`).

    On the CPU a float32 matrix goes through numpy's kernel: torch's CPU argmax over a row
    is 20-25x slower (measured with torch 2.13: ~230 us for 5 x 32,000 against ~9 us), and
    greedy drafting and acceptance take an argmax every token.
    """
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2:
        return torch.from_numpy(rows.detach().numpy().argmax(axis=1)).long()
    return rows.argmax(dim=-1)


def greedy_tokens(rows: Tensor) -> list[int]:  # rows: [n, vocab]
    """Each row's argmax (`argmax_rows`) as ints; InvalidArgumentError when a row's maximum is
    not finite (a NaN, +inf, or every entry -inf): a greedy choice needs a finite best."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2:
        values = rows.detach().numpy()
        best = values.argmax(axis=1)
        finite = bool(np.isfinite(values[np.arange(len(best)), best]).all())
        tokens = best.tolist()
    else:
        best_t = rows.argmax(dim=-1)
        finite = bool(torch.isfinite(rows.gather(1, best_t[:, None])).all())
        tokens = best_t.tolist()
    if not finite:
        raise InvalidArgumentError("a greedy row has NaN, +inf or no max")
    return tokens


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:  # logits: [n, vocab]
    """Return the float32 distribution `[n, vocab]` each row's token is actually drawn from.

    Greedy (temperature 0): exactly one-hot at the argmax; ties go to the lowest index, as with
    `torch.argmax`. Otherwise, in this order: divide by the temperature and softmax in float32;
    top-k keeps exactly `top_k` tokens, the most probable ones, and among tokens tied at the
    boundary the lowest ids survive (a stable sort, so the result never depends on how
    `torch.topk` orders ties on a given device); top-p then keeps, from the renormalised top-k
    distribution, the smallest prefix of most probable tokens whose mass reaches `top_p`
    (always at least the most probable token; ties ordered by id again); finally the kept
    entries are renormalised. Logits may hold -inf (masked tokens) but not NaN or +inf.
    """
    _check_logits(logits)
    n, vocab = logits.shape
    if params.is_greedy:
        one_hot = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
        return one_hot.scatter_(1, argmax_rows(logits).to(logits.device)[:, None], 1.0)

    logits32 = logits.to(torch.float32)
    # Shift before dividing: a tiny temperature would overflow x / T to +inf, and inf - inf is
    # NaN; (x - max) / T is <= 0, and exactly 0 at the max, so exp cannot overflow and the sum
    # is >= 1. The softmax is spelled out because torch.softmax and Tensor.max(dim) hand even
    # a tiny tensor to the CPU thread pool, which stalls for milliseconds on a busy 2-core box.
    shifted = logits32 - logits32.amax(dim=-1, keepdim=True)
    weights = torch.exp(shifted / params.temperature)
    probs = weights / weights.sum(dim=-1, keepdim=True)

    cut_top_k = NO_TOP_K < params.top_k < vocab
    cut_top_p = params.top_p < NO_TOP_P
    if not (cut_top_k or cut_top_p):
        return probs

    if cut_top_k:
        # The top_k candidates only: a full-vocabulary sort costs ~30 ms per row on a CPU.
        ids = _top_k_ids(probs, params.top_k)
    else:
        ids = torch.arange(vocab, device=probs.device).expand(n, vocab)
    # By probability, most probable first; ties in id order (`ids` ascend, the sort is stable).
    candidates = probs.gather(1, ids)
    sorted_probs, order = candidates.sort(dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_probs, dtype=torch.bool)
    if cut_top_p:
        kept = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = torch.cat([kept.new_zeros(n, 1), kept.cumsum(dim=-1)[:, :-1]], dim=-1)
        # Rank 0 has mass_before 0 < top_p, so at least one token always survives.
        keep_sorted &= mass_before < params.top_p
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep.scatter_(1, ids.gather(1, order), keep_sorted)
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_ids(probs: Tensor, top_k: int) -> Tensor:  # probs: [n, vocab] -> [n, top_k]
    """Each row's `top_k` most probable token ids, ascending; at the boundary the lowest ids
    win a tie, whatever order `torch.topk` returns tied values in."""
    n = probs.shape[0]
    boundary = probs.topk(top_k, dim=-1).values[:, -1:]  # the k-th largest value
    above = probs > boundary
    tied = probs == boundary
    room = top_k - above.sum(dim=-1, keepdim=True)  # how many tied tokens fit, >= 1
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))
    return keep.nonzero()[:, 1].view(n, top_k)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:  # probs: [n, vocab]
    """Draw one token per row with `torch.multinomial`; returns `[n]` int64 token ids."""
    if not isinstance(probs, Tensor) or probs.dim() != 2:
        raise InvalidArgumentError("probs must be a 2-D tensor [n, vocab]")
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


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
