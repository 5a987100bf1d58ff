"""Who sent a call, and until when it may run: `Caller`, what the gRPC and HTTP adapters read off
a call and hand to every entry point of the API.

Contract: a frozen value with no behaviour, importing nothing of `cluster.api`, so that the
service (`cluster.api.service`), its audit (`cluster.api.audit`) and the OpenAI-compatible API
(`cluster.api.openai`) all take it without depending on one another for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """Who sent a call, and until when it may run: what the gRPC adapters read off the call."""

    authorization: str | None = None
    """The `authorization` metadata ("Bearer <key>"), if sent."""
    deadline: float | None = None
    """The client's deadline as a `time.monotonic()` instant, if it set one."""


ANONYMOUS_CALL = Caller()
"""A call with no metadata and no deadline (in-process callers, tests)."""
