"""What outcome-keyed pre-drafting costs and earns, for the adaptive plan: pure arithmetic.

The plan (`cluster.routing.goodput`) prices each way of running the next round and keeps
the fastest. A pre-drafted round of a k-token block at fan-out F:

- hits with probability h(alpha, k, F): the odds of the F likeliest (accept length, rank)
  outcomes (`branch_odds`; the accept length's at the request's measured acceptance, times
  `RANK_PRIOR` over the draft's choices), scaled by how often this request's guesses have
  actually hit against those odds (`hit_scale`, `DraftLength.observe_predraft_outcome`);
- waits for the longer of the verify pass and the pre-draft: F branches of `branch_steps(k)`
  drafter steps each, every step holding F rows of this session (and, in the symmetric case the
  plan takes, F rows of each of the drafter's other sessions);
- on a miss then drafts the next block afresh, k steps alone;
- commits E(k) tokens: the bonus token is never deferred, since a hit's block follows it.

So a drafter with spare capacity (a flat step cost curve: F rows cost about one) pre-drafts
wide, and a loaded one (each row adds to every step of every session) falls to F = 1 or to
plain pipelining, or to serial rounds, as the same rule prices them all against each other.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from cluster.runtime.predraft import accept_odds

RANK_PRIOR = (0.6, 0.2, 0.1)
"""P(the committed token is the draft's choice of rank r): after a rejection, among the draft's
tokens other than the one rejected; after a whole block, the share the draft's favourite misses
is spread the same way."""


def branch_odds(alpha: float, k: int) -> list[tuple[float, int, int]]:
    """Every (probability, accepted, rank) outcome of verifying a k-token block at per-position
    acceptance `alpha` that a branch can name, likeliest first (ties: fewer accepted, then
    lower rank)."""
    scored: list[tuple[float, int, int]] = []
    for accepted, p in enumerate(accept_odds(alpha, k)):
        ranks = RANK_PRIOR if accepted < k else (alpha, *((1 - alpha) * r for r in RANK_PRIOR))
        scored.extend((p * r, accepted, rank) for rank, r in enumerate(ranks))
    scored.sort(key=lambda s: (-s[0], s[1], s[2]))
    return scored


def hit_odds(alpha: float, k: int, fan_out: int) -> float:
    """P(the verdict of a k-token block is one of the `fan_out` likeliest branches)."""
    curve = _hit_curve(alpha, k)
    return curve[min(max(0, fan_out), len(curve) - 1)]


@functools.lru_cache(maxsize=64)
def _hit_curve(alpha: float, k: int) -> tuple[float, ...]:
    """`hit_odds` at every fan-out from 0 up to every branch: a plan prices each k at many
    fan-outs, with the same acceptance."""
    return (0.0, *itertools.accumulate(p for p, _, _ in branch_odds(alpha, k)))


def branch_steps(num_tokens: int) -> int:
    """Drafter steps a branch of a `num_tokens` block takes: one to name its token (the
    draft's odds after the outcome's prefix), then one per drafted token."""
    return num_tokens + 1


def predrafted_seconds(hit: float, verify_s: float, predraft_s: float, redraft_s: float) -> float:
    """Expected wall time of a pre-drafted round: the longer of its verify pass and its
    pre-draft, then, on a miss (1 - `hit`), a draft of the next block alone (`redraft_s`)."""
    return max(verify_s, predraft_s) + (1.0 - hit) * redraft_s


@dataclass(frozen=True)
class PredraftCost:
    """What pre-drafting costs this request, for pricing plans with a fan-out."""

    max_fan_out: int
    """The widest fan-out it may take (0: it never pre-drafts)."""
    step_s: Callable[[int], float]
    """Seconds of one drafter step holding `fan_out` rows of this session, while a verify
    pass runs."""
    hit_scale: float = 1.0
    """How often its branches hit, against the odds they were chosen by."""
    extra_s: Callable[[int], float] = lambda fan_out: 0.0
    """Seconds a pre-draft of `fan_out` branches takes beyond its steps (measured)."""

    def hit(self, acceptance: float, k: int, fan_out: int) -> float:
        return min(1.0, hit_odds(acceptance, k, fan_out) * self.hit_scale)

    def seconds(self, k: int, fan_out: int) -> float:
        """Seconds of pre-drafting `fan_out` branches of a k-token block."""
        return max(0.0, branch_steps(k) * self.step_s(fan_out) + self.extra_s(fan_out))

    def rates(
        self, acceptance: float, k: int, tokens: float, verify_s: float, redraft_s: float
    ) -> list[tuple[int, float]]:
        """(fan-out, tokens per second) of a k-token block's pre-drafted rounds, from F = 1 up
        to the rate's peak: the odds of a hit grow ever more slowly with F and its steps grow
        dearer, so the rate rises to one peak. `tokens` per round, `verify_s` of its verify
        pass beside the branches, `redraft_s` to draft the block alone after a miss. What
        `rate` gives each, in one pass: the plan prices every block length at each F."""
        curve, steps = _hit_curve(acceptance, k), branch_steps(k)
        priced: list[tuple[int, float]] = []
        best = 0.0
        for fan_out in range(1, self.max_fan_out + 1):
            hit = min(1.0, curve[min(fan_out, len(curve) - 1)] * self.hit_scale)
            predraft_s = max(0.0, steps * self.step_s(fan_out) + self.extra_s(fan_out))
            value = tokens / predrafted_seconds(hit, verify_s, predraft_s, redraft_s)
            if value < best:
                break
            best = value
            priced.append((fan_out, value))
        return priced
