"""A replica's session limits (`SessionLimits`) and the defaults every layer above names.

Plain data, validated when built, no I/O: stdlib and `cluster.runtime.errors` only, so that a
config (`DrafterConfig`, `VerifierConfig`, `TandemConfig`) can be read without loading torch or
a model. The session table (`cluster.runtime.session`) and the engine's scheduler
(`cluster.runtime.scheduler`) apply these limits; they are named here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.runtime.errors import InvalidArgumentError

MAX_BLOCK_TOKENS = 32
"""Longest draft block: the most a request may ask for, and by default the most a drafter
drafts and a verifier accepts in one call."""
MAX_PREDRAFT_FAN_OUT = 8
"""The most outcomes of a verify pass a request may have pre-drafted at once (its
`predraft_fan_out`): each is a fork of its drafter session, drafted beside the verify pass."""
DEFAULT_MAX_SESSIONS = 256
DEFAULT_MAX_CONTEXT_TOKENS = 4096
DEFAULT_SESSION_TTL_S = 600.0

DEFAULT_KV_CACHE_FRACTION = 0.2
DEFAULT_KV_OVERCOMMIT = 2.0
DEFAULT_KV_BLOCK_SIZE = 16

DEFAULT_MAX_STEP_TOKENS = 256
"""Tokens one forward pass takes at most (prefill chunks fill what decodes leave)."""
DEFAULT_MAX_STEP_SEQUENCES = 64
"""Sessions one forward pass takes at most."""
GATHER_SHARE = 0.5
"""A step waits for sessions about to come back at most GATHER_SHARE of its predicted time,
and never more than the scheduler's MAX_GATHER_S (`Scheduler.to_gather`). A session left behind
waits a whole step, so waiting for it pays whenever it comes back within a step and the step's
cost barely grows with its batch (a GPU's decode); half a step bounds what the others pay for
it."""


@dataclass(frozen=True)
class SessionLimits:
    """The session limits of one replica; `DrafterConfig` and `VerifierConfig` extend it."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    """Sessions held at once; one more is refused with RESOURCE_EXHAUSTED."""
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    """Committed tokens plus a block may not exceed this."""
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    """A session unused this long is evicted (its client or router is gone); requests touch
    their sessions every round, so only abandoned ones idle this long."""
    kv_cache_bytes: int = 0
    """Bytes of the replica's paged KV pool; 0: `kv_cache_fraction` of the device's free
    memory, capped at what `max_sessions` sessions of `max_context_tokens` could use."""
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    kv_overcommit: float = DEFAULT_KV_OVERCOMMIT
    """Admission plans each session's growth (prompt plus its max_tokens, within the context
    limit) and admits one more only while the plans of all open sessions fit in this many
    times the KV pool: above 1 it bets that requests stop early (most end at EOS), and when
    they do not, the engine preempts the newest sessions and recomputes them later."""
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    """Tokens per KV block (rollback frees whole blocks)."""
    max_step_tokens: int | None = None
    """Tokens one batched forward pass takes at most (long prompts are prefilled in chunks);
    None: the device's own budget (a simulated GPU's profile's), else DEFAULT_MAX_STEP_TOKENS."""
    max_step_sequences: int | None = None
    """Sessions one batched forward pass takes at most; None: as for `max_step_tokens`
    (DEFAULT_MAX_STEP_SEQUENCES)."""
    gather_share: float = GATHER_SHARE
    """A step waits for sessions about to come back (their next call due within this share of
    the step's predicted time) at most that long, so that they share it; 0: never waits."""

    _counts: ClassVar[tuple[str, ...]] = (
        "max_sessions",
        "max_context_tokens",
        "kv_block_size",
        "max_step_tokens",
        "max_step_sequences",
    )
    """Fields that must be >= 1, checked in this order (a subclass appends its own)."""

    def __post_init__(self) -> None:
        for name in self._counts:
            value = getattr(self, name)
            if value is not None and value < 1:  # None: a budget left to the device
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
        if not self.session_ttl_s > 0:
            raise InvalidArgumentError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        if self.kv_cache_bytes < 0:
            raise InvalidArgumentError(f"kv_cache_bytes must be >= 0, got {self.kv_cache_bytes}")
        if not 0 <= self.gather_share <= 1:
            raise InvalidArgumentError(f"gather_share must be in [0, 1], got {self.gather_share}")
        if not self.kv_overcommit >= 1:
            raise InvalidArgumentError(f"kv_overcommit must be >= 1, got {self.kv_overcommit}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise InvalidArgumentError(
                f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}"
            )
