"""The router's bounded queue: at most `max_running` requests generate at once, at most
`max_queued` wait, and the rest are refused at once with RESOURCE_EXHAUSTED (never an unbounded
backlog in memory).

When a running request ends, the waiting request that goes next is the one whose tenant has the
fewest running requests per unit of weight (ties: the longest waiting). A tenant of weight 2
thus gets about twice the share of a busy router that a tenant of weight 1 gets, and a tenant
with a burst of requests cannot starve one with a single request waiting. A request waits at
most until its deadline (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from cluster.api.tenants import QuotaExceededError
from cluster.routing.waits import Wait, Waits, run
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError

QUEUE_FULL_RETRY_S = 1.0
"""When to retry after a full queue: a few requests' worth of time at least."""
WAIT_POLL_S = 0.5
"""How often a waiting request looks at its deadline."""


@dataclass
class _Waiter:
    tenant: str
    weight: float
    order: int
    granted: Future[None] = field(default_factory=Future)
    """Done once the request may run (a driver of waits waits on it without a thread)."""


class Admission:
    """Admits requests to the router in weighted fair order; thread-safe."""

    def __init__(
        self,
        max_running: int,
        max_queued: int,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_change(running, queued)` is called, under the queue's lock, whenever either
        changes (the metrics' queue gauges): it must be quick and must not call back."""
        if max_running < 1 or max_queued < 0:
            raise InvalidArgumentError(
                f"need max_running >= 1 and max_queued >= 0, got {max_running}, {max_queued}"
            )
        self.max_running = max_running
        self.max_queued = max_queued
        self._clock = clock
        self._cond = threading.Condition()
        self._running: Counter[str] = Counter()
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()
        self._on_change = on_change

    def enter(
        self,
        tenant: str,
        weight: float = 1.0,
        deadline: float | None = None,
    ) -> None:
        """Wait for a place to run; raises QuotaExceededError (RESOURCE_EXHAUSTED) if the
        queue is full, DeadlineExceededError once `deadline` (the clock's time) passes."""
        run(self.entering(tenant, weight, deadline))

    def entering(
        self,
        tenant: str,
        weight: float = 1.0,
        deadline: float | None = None,
    ) -> Waits[None]:
        """`enter` as waits (`cluster.routing.waits`): a queued request waits without a
        thread of its own."""
        with self._cond:
            if not self._waiting and self.running < self.max_running:
                self._running[tenant] += 1
                self._changed()
                return
            if len(self._waiting) >= self.max_queued:
                raise QuotaExceededError(
                    f"the router is at capacity ({self.running} running, "
                    f"{len(self._waiting)} queued)",
                    QUEUE_FULL_RETRY_S,
                )
            waiter = _Waiter(tenant, weight, next(self._order))
            self._waiting.append(waiter)
            self._changed()
        while True:
            with self._cond:
                if waiter.granted.done():
                    return
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    self._waiting.remove(waiter)
                    self._grant()
                    self._changed()
                    raise DeadlineExceededError(
                        "the request's deadline passed while it waited in the router's queue"
                    )
            try:
                yield Wait(waiter.granted, WAIT_POLL_S if left is None else min(WAIT_POLL_S, left))
            except GeneratorExit:  # the caller left while queued: its place goes to the next
                if waiter.granted.done():
                    self.leave(tenant)
                else:
                    with self._cond:
                        self._waiting.remove(waiter)
                        self._changed()
                raise

    def leave(self, tenant: str) -> None:
        """A request admitted by `enter` has ended."""
        with self._cond:
            self._running[tenant] -= 1
            if self._running[tenant] <= 0:
                del self._running[tenant]
            self._grant()
            self._changed()

    @property
    def running(self) -> int:
        return sum(self._running.values())

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _changed(self) -> None:
        """Tell `on_change` the counts now (lock held)."""
        if self._on_change is not None:
            self._on_change(self.running, len(self._waiting))

    def _grant(self) -> None:
        """Let waiting requests in while there is room, fairest first (lock held)."""
        while self._waiting and self.running < self.max_running:
            chosen = min(self._waiting, key=lambda w: (self._running[w.tenant] / w.weight, w.order))
            self._waiting.remove(chosen)
            self._running[chosen.tenant] += 1
            chosen.granted.set_result(None)
