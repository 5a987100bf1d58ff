"""The requests a router replica is running, each with the tenant it belongs to.

Isolation: a tenant can cancel only its own requests. Asking about another tenant's request id
gets the same NOT_FOUND as an id that never existed, so ids tell nobody anything about other
tenants' traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.runtime.errors import TandemError


class RequestNotFoundError(TandemError):
    """No running request of the caller has this id."""

    status = "NOT_FOUND"


class RunningRequests:
    """Request id -> (tenant, cancel flag) for the requests running now; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, tuple[str, threading.Event]] = {}

    @contextmanager
    def running(self, request_id: str, tenant: str) -> Iterator[threading.Event]:
        """Register a request while the block runs; the event is set when it is cancelled."""
        cancelled = threading.Event()
        with self._lock:
            self._running[request_id] = (tenant, cancelled)
        try:
            yield cancelled
        finally:
            with self._lock:
                del self._running[request_id]

    def cancel(self, request_id: str, tenant: str) -> None:
        """Cancel `tenant`'s running request `request_id`."""
        with self._lock:
            entry = self._running.get(request_id)
        if entry is None or entry[0] != tenant:
            raise RequestNotFoundError(f"no running request {request_id!r} of yours")
        entry[1].set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)
