"""Seed-exact sampling: the Gumbel-max draw whose noise depends only on (seed, position, token).

Contract: pure functions of tensors and Python ints; no model, no I/O, no generator state. The
token at position `t` of a seeded request is

    argmax over x of  log p(x) + G(seed, t, x)

where `p` is the distribution actually sampled from (`sampling.logits_to_probs`: temperature,
top-k and top-p applied) and `G` is standard Gumbel noise. That is an exact draw from `p` (the
Gumbel-max trick), and it is a function of (seed, t, p) alone: no draw order, no process, no
device and no neighbour in a batch enters it. A drafter that draws its proposal with the same
`G` from its own q proposes the target's token whenever the two argmaxes agree, and the verifier
accepts a drafted token exactly when it equals the target's own draw, so the output is the same
whatever drafted it, however long the blocks, and wherever the request ran (arXiv 2408.07978).

Words
    position     the index the token gets in its sequence: the number of tokens before it (the
                 prompt's length for the first generated token).
    key          two 32-bit words from (seed, position) by SplitMix64 (`row_key`).
    exponential  for token id x: two rounds of a 32-bit integer mix of x with the key's words,
                 a uniform u = (h + 1/2) / 2**32 in (0, 1), and E = -log(u) in float64: an
                 Exp(1) draw to within 2**-32 in probability. The integer arithmetic is int64
                 that never overflows (every product stays below 2**63), so every device
                 computes the same bits.
    the draw     argmax over x of p(x) / E(x), in float64, the lowest id on a tie. With
                 G = -log(E) this is argmax log p(x) + G(x): the same Gumbel-max draw, in its
                 exponential-race form, which costs one logarithm per token instead of three.

E is bounded on both sides, so only tokens within `CANDIDATE_RATIO` of their row's best
probability can win; E is computed for those candidates alone, which for a confident model is
a few hundred ids of a 151,936-id row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MIX32 = 0x045D9F3B
"""The multiplier of a well-tested 32-bit integer hash; below 2**27, so a product with a 32-bit
value stays below 2**59 in int64."""

EXPONENTIAL_MIN = -math.log((_MASK32 + 0.5) / 2**32)
"""The smallest exponential any token can get (u at its largest)."""
EXPONENTIAL_MAX = -math.log(0.5 / 2**32)
"""The largest exponential any token can get (u at its smallest)."""
CANDIDATE_RATIO = EXPONENTIAL_MIN / EXPONENTIAL_MAX * (1 - 1e-6)
"""A token whose probability is below this share of its row's best can never win: even with
the smallest exponential against the best token's largest, its ratio would lose (the factor
leaves slack for float32 rounding)."""


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_key(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit key words of the noise at `position` of a request seeded with `seed`."""
    if not 0 <= seed <= _MASK64:
        raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {seed}")
    if not 0 <= position <= _MASK64:
        raise InvalidArgumentError(f"position must be >= 0, got {position}")
    key = _splitmix64(_splitmix64(seed) ^ position)
    return key & _MASK32, key >> 32


def _mix(h: Tensor) -> Tensor:  # int64 holding uint32 values -> the same
    h = ((h >> 16) ^ h) * _MIX32 & _MASK32
    h = ((h >> 16) ^ h) * _MIX32 & _MASK32
    return (h >> 16) ^ h


def exponentials(token_ids: Tensor, keys: Tensor) -> Tensor:
    """E(key, x) for each (key, token id) pair: float64 in (0, 23), `token_ids`' shape.

    `token_ids`: int64, any shape; `keys`: int64 `[..., 2]` (the two words of `row_key`),
    broadcastable against it."""
    first, second = keys[..., 0], keys[..., 1]
    h = _mix(_mix(token_ids ^ first) ^ second)
    return (h.to(torch.float64).add_(0.5).mul_(2.0**-32)).log_().neg_()


def exponential_row(seed: int, position: int, vocab_size: int) -> Tensor:
    """E(seed, position, x) for every token id x in 0..vocab_size-1: float64 `[vocab_size]`."""
    keys = torch.tensor(row_key(seed, position), dtype=torch.int64)
    return exponentials(torch.arange(vocab_size, dtype=torch.int64), keys)


def gumbel_tokens(probs: Tensor, seeds: Sequence[int], positions: Sequence[int]) -> list[int]:
    """Each row's seed-exact token: argmax over x of probs[i, x] / E(seeds[i], positions[i], x).

    `probs`: `[n, vocab]`, each row a distribution as used (a zero is never drawn); the ratio
    is taken in float64 of the row's float32 values. Ties go to the lowest id.
    InvalidArgumentError on a shape mismatch or a row with no positive probability."""
    if not isinstance(probs, Tensor) or probs.dim() != 2:
        raise InvalidArgumentError("probs must be a 2-D tensor [n, vocab]")
    n = probs.shape[0]
    if len(seeds) != n or len(positions) != n:
        raise InvalidArgumentError(
            f"gumbel_tokens needs a seed and a position per row: {n} rows, {len(seeds)} seeds, "
            f"{len(positions)} positions"
        )
    if n == 0:
        return []
    probs32 = probs.to(torch.float32)
    best = probs32.amax(dim=-1, keepdim=True)  # [n, 1]
    if not bool((best > 0).all()) or not bool(torch.isfinite(best).all()):
        raise InvalidArgumentError("every row needs a positive, finite probability to draw from")
    candidates = probs32 >= best * CANDIDATE_RATIO  # [n, vocab]
    rows, ids = candidates.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    keys = torch.tensor(
        [row_key(seed, position) for seed, position in zip(seeds, positions, strict=True)],
        dtype=torch.int64,
        device=probs.device,
    )  # [n, 2]
    ratios = probs32[rows, ids].to(torch.float64) / exponentials(ids, keys[rows])
    counts = candidates.sum(dim=-1).tolist()
    # torch.argmax returns the first maximum: the lowest id of a tie.
    winners = [int(part.argmax()) for part in ratios.split(counts)]
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
    return ids[torch.tensor([s + w for s, w in zip(starts, winners, strict=True)])].tolist()
