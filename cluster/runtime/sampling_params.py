"""How one request turns logits into a token: `SamplingParams`, validated when built.

Contract: plain data, no torch. A `SamplingParams` that exists is valid: a finite temperature
>= 0 (0: greedy), a top-k >= 0 (`NO_TOP_K`: the whole vocabulary), a finite top-p with
0 < top-p <= 1 (`NO_TOP_P`: no nucleus cut), and a bool `seed_exact`; anything else is refused
with an `InvalidArgumentError` naming the field. What the settings do to logits is
`cluster.runtime.sampling`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    seed_exact: bool = False
    """Draw each token by the seed-exact rule (`cluster.runtime.gumbel`): a function of the
    seed, the position and this distribution alone, whatever drafted the block. False: the
    rejection rule, which accepts more drafts but whose tokens depend on the draw order.
    Greedy requests ignore it (argmax needs no noise)."""

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
        if not isinstance(self.seed_exact, bool):
            raise InvalidArgumentError(f"seed_exact must be a bool, got {self.seed_exact!r}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def draws_seed_exact(self) -> bool:
        """True when tokens are sampled by the seed-exact rule (not greedy, `seed_exact`)."""
        return self.seed_exact and not self.is_greedy
