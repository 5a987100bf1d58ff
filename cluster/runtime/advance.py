"""How far a verifier session advances on its own: the output's end, as the verifier sees it.

A session opened with an `Advance` is *running*: after its prefill, the verifier's engine puts
it in every step, verifying the block its router sent if one is there and the target's own next
token otherwise (docs/architecture.md, "The verifier drives each session"). The router still
decides what reaches the caller (stop strings, cancellation, deadlines) and closes the session;
the verifier only needs to know where the output must end whatever the router says, so that it
does not run on past it: at `max_length` tokens, or after an end token at a position from
`ends_from` on (the request's end-of-sequence ids unless it ignores them, and its
`stop_token_ids`, counted once `min_tokens` are out). Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class Advance:
    """Where a running session stops advancing on its own (positions are sequence indices:
    the prompt's tokens come first)."""

    max_length: int
    """The sequence's longest length: the prompt plus the request's `max_tokens`."""
    end_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Tokens that end the output."""
    ends_from: int = 0
    """The first position at which an end token ends the output (`min_tokens` after the
    prompt)."""

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.ends_from < 0:
            raise InvalidArgumentError(
                f"max_length must be >= 1 and ends_from >= 0, got {self.max_length}, "
                f"{self.ends_from}"
            )

    def ended(self, start: int, tokens: Sequence[int]) -> bool:
        """Whether `tokens`, committed at positions `start`, `start + 1`, ..., end the output
        (an end token from `ends_from` on, or the sequence at `max_length`)."""
        if start + len(tokens) >= self.max_length:
            return True
        ends = self.end_token_ids
        if not ends:
            return False
        first = max(self.ends_from - start, 0)
        return any(token in ends for token in tokens[first:])
