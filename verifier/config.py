"""The verifier side's config: a verifier replica's limits (`VerifierConfig`), and the weights
a reference replay may ask for (`REFERENCE_DTYPES`).

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

    _counts: ClassVar[tuple[str, ...]] = (*SessionLimits._counts, "max_block_tokens")
