"""The online audit's settings (`AuditConfig`): what share of finished requests is replayed, in
which weights, and how many may wait.

Plain data, validated when built, no I/O: it imports no component (the audit itself is
`cluster.api.online_audit`, which replays through the router), so that a config
(`TandemConfig.audit`) is read without loading the API, the router or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.runtime.errors import InvalidArgumentError
from verifier.config import OWN_DTYPE, check_reference_dtype

DEFAULT_MAX_PENDING = 64


@dataclass(frozen=True)
class AuditConfig:
    """The online audit of the router's finished requests."""

    fraction: float = 0.0
    """Share of finished greedy and seed-exact requests replayed through the target alone and
    compared token by token, in [0, 1]; 0: no online audit."""
    dtype: str = OWN_DTYPE
    """The weights of the replays: "" the verifiers' own, "float32" a float32 copy of the
    target on each verifier (made on its first audit, then kept: the model's size again)."""
    max_pending: int = DEFAULT_MAX_PENDING
    """Audits that may wait for the worker; a request drawn beyond them is dropped and
    counted (`tandem_audit_dropped_total{reason="queue_full"}`)."""

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise InvalidArgumentError(f"fraction must be a number in [0, 1], got {fraction!r}")
        if not (math.isfinite(fraction) and 0 <= fraction <= 1):
            raise InvalidArgumentError(f"fraction must be in [0, 1], got {fraction!r}")
        check_reference_dtype(self.dtype)
        if isinstance(self.max_pending, bool) or self.max_pending < 1:
            raise InvalidArgumentError(f"max_pending must be >= 1, got {self.max_pending!r}")
