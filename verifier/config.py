"""The verifier side's config: a verifier replica's limits and injected fault (`VerifierConfig`),
and the weights a reference replay may ask for (`REFERENCE_DTYPES`).

Plain data, validated when built, no I/O: no torch, no model, no component, so that a config
file can be read (`cluster.config.TandemConfig`) and an audit request checked without loading
what they name. The components take them: `verifier.verifier.Verifier` and
`verifier.audit_replica.ReferenceReplayer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_BLOCK_TOKENS, SessionLimits

NO_FAULT = ""
ACCEPT_ALL = "accept_all"
REUSED_NOISE = "reused_noise"
DRAFT_STREAM = "draft_stream"
UNMASKED_BONUS = "unmasked_bonus"
FAULTS = (NO_FAULT, ACCEPT_ALL, REUSED_NOISE, DRAFT_STREAM, UNMASKED_BONUS)

OWN_DTYPE = ""
FLOAT32 = "float32"
REFERENCE_DTYPES = (OWN_DTYPE, FLOAT32)
"""What a reference may ask for: the replica's own weights, or a float32 copy of them."""


def check_reference_dtype(dtype: str, what: str = "dtype") -> str:
    """`dtype` if a reference may ask for it; InvalidArgumentError naming `what` if not."""
    if dtype not in REFERENCE_DTYPES:
        raise InvalidArgumentError(
            f"{what} must be one of {', '.join(map(repr, REFERENCE_DTYPES))}, got {dtype!r}"
        )
    return dtype


@dataclass(frozen=True)
class VerifierConfig(SessionLimits):
    """Limits of one verifier replica."""

    max_block_tokens: int = MAX_BLOCK_TOKENS
    """Longest draft block accepted."""
    fault: str = NO_FAULT
    """A fault injected on purpose, for the tests and the audit's own checks; "" (none) in
    production. `accept_all`: every drafted token is accepted, whatever the target says.
    `reused_noise`: the seed-exact rule keys its noise by the seed alone, the same at every
    position. `draft_stream`: the seed-exact rule draws the target's tokens of a block with
    drafts from another noise stream (the rejection rule's drafter stream) than a block
    without, so the output depends on how the request was drafted. `unmasked_bonus`: the
    position after a block's last draft is not masked by the request's constraint."""

    _counts: ClassVar[tuple[str, ...]] = (*SessionLimits._counts, "max_block_tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fault not in FAULTS:
            raise InvalidArgumentError(
                f"fault must be one of {', '.join(map(repr, FAULTS))}, got {self.fault!r}"
            )
