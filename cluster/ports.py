"""The interfaces through which the router drives a drafter and a verifier.

The plain `drafter.Drafter` and `verifier.Verifier` satisfy them directly (the in-process
transport); the gRPC transport implements them with a client per replica. The router depends on
these protocols only, so the same router code runs in-process and distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from verifier.block import DraftBlock, Verdict
from verifier.sampling import SamplingParams


class DrafterPort(Protocol):
    def open_session(
        self, session_id: str, prompt_tokens: Sequence[int], sampling: SamplingParams, seed: int
    ) -> int:
        """Open a session; returns its committed length."""
        ...

    def draft(
        self, session_id: str, base_length: int, appended_tokens: Sequence[int], num_tokens: int
    ) -> DraftBlock:
        """Append the tokens committed since `base_length`, then draft `num_tokens`."""
        ...

    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        ...


class VerifierPort(Protocol):
    def open_session(
        self, session_id: str, prompt_tokens: Sequence[int], sampling: SamplingParams, seed: int
    ) -> int:
        """Open a session; returns its committed length."""
        ...

    def verify(self, session_id: str, block: DraftBlock) -> Verdict:
        """Verify `block` and commit the emitted tokens."""
        ...

    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        ...
