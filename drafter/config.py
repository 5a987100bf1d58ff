"""The drafter side's configs: a drafter replica's limits (`DrafterConfig`), prompt lookup's
settings (`NgramConfig`) and the suffix drafter's (`SuffixConfig`).

Plain data, validated when built, no I/O: no torch, no model, no component, so that a config
file can be read (`cluster.config.TandemConfig`) without loading what it configures. The
components take them: `drafter.drafter.Drafter` and `cluster.routing.prompt_lookup.PromptLookup`.
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


SUFFIX_SCOPES = ("tenant", "request")


@dataclass(frozen=True)
class SuffixConfig:
    """The suffix drafter: continuations of what earlier requests (and this one) wrote, drafted
    from suffix indexes held on CPU-only replicas (`drafter.suffix_index`, `drafter.suffix`).

    Its drafts are deterministic, so their q is one-hot and acceptance stays exact for every
    sampling rule; they only move speed."""

    enabled: bool = True
    scope: str = "tenant"
    """Whose text drafts for a request: "tenant" (every request of the same tenant, the
    default) or "request" (its own prompt and output only). Never another tenant's: what a
    draft proposes shows in acceptance and timing, so a tree shared across tenants would tell
    one tenant whether another wrote the same text."""
    max_tokens: int = 16
    """Longest block drafted; a block ends earlier where its confidence falls."""
    min_match: int = 2
    """Shortest suffix of the context that must recur for a proposal."""
    max_match: int = 16
    """Longest suffix of the context compared when ranking earlier occurrences."""
    max_candidates: int = 64
    """Earlier occurrences weighed per proposal (the most recent first): bounds its CPU."""
    min_confidence: float = 0.25
    """A block ends before the token whose running confidence (the product of each token's
    share among the occurrences still matching) would fall below this."""
    tokens_per_match: float = 1.0
    """A block is at most this many tokens per token of the context's longest suffix that
    recurs (at least one; 0: no such cap): a 2-token match is weaker evidence than a 16-token
    one, and a rejected long block costs the verifier a longer pass."""
    tenant_bytes: int = 64 * 1024 * 1024
    """Memory cap of one tenant's index, in bytes; the oldest requests are evicted first."""

    def __post_init__(self) -> None:
        if self.scope not in SUFFIX_SCOPES:
            raise InvalidArgumentError(
                f"scope must be one of {', '.join(SUFFIX_SCOPES)}, got {self.scope!r}"
            )
        for name in ("max_tokens", "min_match", "max_candidates", "tenant_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_match, bool) or not isinstance(self.max_match, int):
            raise InvalidArgumentError(f"max_match must be an int, got {self.max_match!r}")
        if self.max_match < self.min_match:
            raise InvalidArgumentError(
                f"need min_match <= max_match, got {self.min_match} and {self.max_match}"
            )
        per_match = self.tokens_per_match
        if isinstance(per_match, bool) or not isinstance(per_match, int | float) or per_match < 0:
            raise InvalidArgumentError(f"tokens_per_match must be >= 0, got {per_match!r}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise InvalidArgumentError(
                f"min_confidence must be in [0, 1], got {self.min_confidence}"
            )
