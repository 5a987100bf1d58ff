"""How long a request's draft blocks may be: the bounds a request's `draft_tokens` takes, and how
the router's adaptive plan picks each block's length within them (`DraftLengthConfig`).

Plain data, validated when built, no I/O: stdlib and `cluster.runtime` plain modules only, so
that a config (`TandemConfig.draft_length`, `ServiceConfig.default_draft_tokens`) is read
without loading torch. The plan itself is `cluster.routing.draft_length`; a request's bounds are
checked in `cluster.routing.request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_BLOCK_TOKENS

MAX_DRAFT_TOKENS = MAX_BLOCK_TOKENS
"""Longest draft block a request may ask for: what replicas serve by default."""
DEFAULT_DRAFT_TOKENS = 4
"""Draft block length of a request that sets none (`ServiceConfig.default_draft_tokens`)."""


@dataclass(frozen=True)
class DraftLengthConfig:
    """How the router picks each block's length (up to the request's draft_tokens)."""

    enabled: bool = False
    """False: every block has the request's draft_tokens."""
    prior_accepted: float = 3.0
    prior_rejected: float = 1.0
    """A Beta(3, 1) prior: an acceptance of 0.75 until the request shows otherwise."""
    decay: float = 0.9
    """Weight kept by past outcomes per verify pass: about the last 10 passes count."""
    latency_decay: float = 0.8
    """Weight kept by past draft and verify latencies per measurement."""
    measured_modes: bool = True
    """Each request also keeps the drafting (the draft model, lookup only, the target alone)
    its own measured tokens per second says pays (`cluster.routing.draft_modes`), starting
    from what the replicas' start-up measurement says; only with `enabled`."""
    speculation_gate: bool = True
    """While two or more requests run, the router also measures speculation against the
    target alone for the router as a whole and keeps the better
    (`cluster.routing.speculation_gate`); only with `enabled`."""

    def __post_init__(self) -> None:
        if self.prior_accepted <= 0 or self.prior_rejected <= 0:
            raise InvalidArgumentError("prior_accepted and prior_rejected must be > 0")
        for name in ("decay", "latency_decay"):
            if not 0 <= getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be in [0, 1), got {getattr(self, name)}")
