"""Saguaro-style draft distributions: the draft's q with its favourites damped.

Contract: one pure function of a tensor; no model, no I/O, no random state. With a scale s in
(0, 1] and a count m, q' is q with the probability of each row's m most probable tokens
multiplied by s, then renormalised:

    q'(x) = w(x) q(x) / sum_y w(y) q(y),   w(x) = s if x is among the top m, else 1.

Why: after a rejection the verifier draws its correction from the residual max(0, p - q'),
and the smaller q' is on the draft's own favourites, the more of that residual sits on them,
so the correction is more often a token the pre-drafted branches guessed (the draft's top
choices). Lossless whatever s and m are: a sampled draft reports the q' it was actually drawn
from, and the rejection rule is exact for any proposal it is told the truth about; only how
often drafts are accepted changes.

Ties: every token whose probability equals the m-th largest is damped with it, so exactly
which tokens are damped never depends on how a device orders equal values. Tokens of zero
probability stay at zero, so q' has q's support. With s = 1 the rows come back unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError


def check_saguaro(scale: float, top: int) -> None:
    """InvalidArgumentError unless 0 < scale <= 1 and top >= 1."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0.0 < scale <= 1.0:
        raise InvalidArgumentError(f"the Saguaro scale must be in (0, 1], got {scale!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgumentError(f"the Saguaro top count must be an int >= 1, got {top!r}")


def saguaro_probs(probs: Tensor, scale: float, top: int) -> Tensor:  # [n, vocab] -> same
    """q' of each row of `probs` (distributions, float): its `top` most probable tokens'
    probability (and any tied with the last of them) multiplied by `scale`, renormalised.
    A new tensor of `probs`' dtype; `probs` itself when `scale` is 1."""
    check_saguaro(scale, top)
    if not isinstance(probs, Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        raise InvalidArgumentError("probs must be a 2-D floating-point tensor [n, vocab]")
    if scale == 1.0 or probs.shape[0] == 0:
        return probs
    kth = probs.topk(min(top, probs.shape[1]), dim=-1).values[:, -1:]  # [n, 1]
    damped = (probs >= kth) & (probs > 0)
    weighted = torch.where(damped, probs * scale, probs)
    return weighted / weighted.sum(dim=-1, keepdim=True)
