"""The drafter side's configs: a drafter replica's limits (`DrafterConfig`) and prompt lookup's
settings (`NgramConfig`).

Plain data, validated when built, no I/O: no torch, no model, no component, so that a config
file can be read (`cluster.config.TandemConfig`) without loading what it configures. The
components take them: `drafter.drafter.Drafter` and `drafter.ngram.PromptLookup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_BLOCK_TOKENS, SessionLimits


@dataclass(frozen=True)
class DrafterConfig(SessionLimits):
    """Limits and drafting policy of one drafter replica."""

    max_draft_tokens: int = MAX_BLOCK_TOKENS
    """Longest block one draft call may ask for."""
    top_k: int = 64
    """Sampled drafts draw from at most this many tokens (0 = the request's own top_k), which
    keeps the q sent per token small; exactness does not depend on it."""
    min_confidence: float = 0.0
    """End a block early after a token the draft model gave less than this probability (its
    most likely token's probability, before truncation): later tokens would likely be
    rejected, and drafting them costs time. 0 drafts every token asked for. The block length
    then depends only on the drafter, so acceptance stays exact."""
    saguaro_scale: float | None = None
    """Saguaro-style drafting: sampled drafts are drawn from the draft's q with its
    `saguaro_top` most probable tokens' probability multiplied by this, renormalised (and
    that q' is what is reported), so the verifier's corrections fall on the draft's top
    tokens, the ones pre-drafted branches guess (`cluster.runtime.saguaro`). In (0, 1];
    None (the default) draws from q itself. Exact either way."""
    saguaro_top: int = 4
    """How many of the draft's most probable tokens Saguaro-style drafting damps; >= 1."""
    error_fraction: float = 0.0
    """Share of Draft calls answered INTERNAL on purpose, for soak tests (`tandem soak`); 0 in
    production. Honoured by one drafter replica only, the one Serve ranks 0
    (`drafter.deployment`), so the others show the healthy path beside it; in [0, 1]."""

    _counts: ClassVar[tuple[str, ...]] = (*SessionLimits._counts, "max_draft_tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise InvalidArgumentError(
                f"min_confidence must be in [0, 1], got {self.min_confidence}"
            )
        scale = self.saguaro_scale
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, int | float) or not 0.0 < scale <= 1.0
        ):
            raise InvalidArgumentError(f"saguaro_scale must be in (0, 1] or None, got {scale!r}")
        if isinstance(self.saguaro_top, bool) or not isinstance(self.saguaro_top, int):
            raise InvalidArgumentError(f"saguaro_top must be an int, got {self.saguaro_top!r}")
        if self.saguaro_top < 1:
            raise InvalidArgumentError(f"saguaro_top must be >= 1, got {self.saguaro_top}")
        if not 0.0 <= self.error_fraction <= 1.0:
            raise InvalidArgumentError(
                f"error_fraction must be in [0, 1], got {self.error_fraction}"
            )


@dataclass(frozen=True)
class NgramConfig:
    """Whether prompt lookup runs, and which suffix lengths it tries, longest first."""

    enabled: bool = False
    max_ngram: int = 4
    min_ngram: int = 2
    """One-token matches are mostly coincidence; two or more are rarely."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidArgumentError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}"
            )
