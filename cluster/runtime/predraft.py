"""Outcome-keyed pre-drafting, the pure part: which outcomes of a verify pass in flight to draft
the next block for, and how often that pays.

A verify pass of a k-token block ends in one *outcome*: the number of the block's tokens the
verifier accepts, `a` in 0..k, and the one token it commits after them (the correction after a
rejection, or the bonus token when all k are accepted). While that pass runs, the drafter can
draft the next block for the outcomes it finds most likely, up to a fan-out F; when the verdict
arrives, an outcome drafted for (a *hit*) has its next block ready at once, and a miss drafts
as a serial round does. Which outcomes are drafted changes only what is proposed: every block
is still verified with the exact acceptance rule, so output is unchanged.

The odds, with per-position acceptance `alpha` (the same model as the adaptive plan's):

- the block stops after `a` accepted tokens with probability alpha^a (1 - alpha) for a < k,
  and alpha^k for a = k (`accept_odds`);
- the token after them, given `a`, is guessed from the draft's own distribution at that
  position (`next_token_odds[a]`: its likely tokens and their probabilities). After a
  rejection the correction is never the token the draft proposed there (the residual
  max(0, p - q) is zero where the draft was rejected), so that token is dropped and the rest
  renormalised.

`likely_outcomes` ranks every (a, token) by the product and keeps the F most likely: this is the
allocation the capped geometric series of speculative speculative decoding approximates, taken
exactly. The sum of their probabilities is the expected hit rate (`hit_rate`).

`Branch` (an accept length and a rank of the draft's choice, what the router asks the drafter
for) and `PreDraft` (a branch drafted) are the two sides' shared vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.runtime.draft_block import StepLoad
from cluster.runtime.sparse_distribution import SparseDistribution


@dataclass(frozen=True, slots=True, order=True)
class Outcome:
    """How a verify pass ends: `accepted` of the block's tokens, then `token`."""

    accepted: int
    token: int


@dataclass(frozen=True, slots=True)
class Branch:
    """Which outcome to draft for: `accepted` tokens of the block, then the draft's choice of
    `rank` (0: its favourite) at that position."""

    accepted: int
    rank: int


@dataclass(frozen=True, slots=True)
class PreDraft:
    """A branch drafted: the outcome it is keyed by (`accepted`, then `token`) and the block
    drafted after that token."""

    accepted: int
    token: int
    tokens: tuple[int, ...]
    draft_probs: Sequence[SparseDistribution] | None = None
    """The exact q each of `tokens` was sampled from (a sampled session's branch), as a
    `DraftBlock`'s; None when drafted deterministically."""
    load: StepLoad | None = None
    """The drafter's load when the branch was drafted (None: not reported): what prices the
    next fan-out while every round hits and no plain draft reports one."""


def accept_odds(alpha: float, k: int) -> tuple[float, ...]:
    """P(a tokens of a k-token block are accepted), a = 0..k, at per-position acceptance
    `alpha`; they sum to 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return (*(alpha**a * (1.0 - alpha) for a in range(k)), alpha**k)


def likely_outcomes(
    block: Sequence[int],
    next_token_odds: Sequence[Sequence[tuple[int, float]]],
    alpha: float,
    fan_out: int,
) -> list[tuple[Outcome, float]]:
    """The `fan_out` most likely outcomes of verifying `block`, most likely first, each with
    its probability.

    `next_token_odds[a]` (a = 0..len(block)): the draft's likely tokens after the first `a`
    tokens of `block` and their probabilities (any subset of its distribution; those left out
    are never guessed). Ties keep the shorter accept length, then the smaller token id, so the
    choice is deterministic."""
    k = len(block)
    if len(next_token_odds) != k + 1:
        raise ValueError(f"need the draft's odds at {k + 1} positions, got {len(next_token_odds)}")
    if fan_out <= 0:
        return []
    ranked: list[tuple[float, Outcome]] = []
    for a, (p_accept, odds) in enumerate(zip(accept_odds(alpha, k), next_token_odds, strict=True)):
        if p_accept <= 0.0:
            continue
        rejected = block[a] if a < k else None
        kept = [(token, p) for token, p in odds if token != rejected and p > 0.0]
        if a < k:
            # The residual of a rejection: the draft's own odds without the rejected token.
            left = 1.0 - sum(p for token, p in odds if token == rejected)
            if left <= 0.0:
                continue
            kept = [(token, p / left) for token, p in kept]
        ranked.extend((p_accept * p, Outcome(a, token)) for token, p in kept)
    ranked.sort(key=lambda pair: (-pair[0], pair[1]))
    return [(outcome, p) for p, outcome in ranked[:fan_out]]


def hit_rate(outcomes: Sequence[tuple[Outcome, float]]) -> float:
    """The probability that the verdict is one of `outcomes` (their odds summed)."""
    return min(1.0, sum(p for _, p in outcomes))
