"""Whether the caller of the call this thread serves is still there.

A replica's handler thread serves one call at a time and hands its work to the engine. The RPC
layer (`cluster.replica.rpc.CallGuard`) knows when the caller has gone (a cancelled or timed out
RPC, a dropped connection); the engine, which must not import gRPC, only needs to know whether
to go on. `call_scope(gone)` tells it for the calls this thread makes inside the scope:
`Engine.submit` keeps the event of the scope it is called in, and drops a task whose event is
set before it runs its next step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

_local = threading.local()


class Gone(Protocol):
    """What the engine asks of a scope: whether its caller has gone (a `threading.Event`, or
    anything as cheap to ask)."""

    def is_set(self) -> bool: ...


@contextmanager
def call_scope(gone: Gone) -> Iterator[None]:
    """Within it, work this thread submits is abandoned once `gone` is set."""
    outer = getattr(_local, "gone", None)
    _local.gone = gone
    try:
        yield
    finally:
        _local.gone = outer


def caller_gone() -> Gone | None:
    """The event of the innermost `call_scope` on this thread (None outside any)."""
    return getattr(_local, "gone", None)
