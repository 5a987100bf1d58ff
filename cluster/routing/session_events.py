"""What a running verifier session tells its router, in order: the session's events.

A running session (`cluster.runtime.advance`) advances on its own, so the router does not ask
for each of its tokens: it reads them. `SessionEvents` is one request's ordered inbox of them,
filled by the transport (a Frames stream's receiver thread, or the in-process verifier's engine
thread) and emptied by the request's loop (`cluster.routing.router`):

- a verdict of a step the session took alone (`post_id` None), or of a block the router posted
  (`post_id`: the number the router gave it; the verdict may say it was dropped);
- an error: the session, or its replica, failed (the router fails the request over).

`ready()` is a future that is done once something is there, for the loop to wait on (with
whatever else it waits for) without a thread; `take()` empties the inbox. Safe from any thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.runtime.draft_block import Verdict


@dataclass(frozen=True, slots=True)
class Event:
    """One report of a running session: `item` a verdict or the error that stopped it;
    `post_id` the router's number of the block it answers (None: a step of its own)."""

    post_id: int | None
    item: Verdict | Exception


class SessionEvents:
    """One running session's reports to its router, in the order they were made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Event] = []
        self._waiter: Future[None] | None = None
        self._closed = False

    def push(self, post_id: int | None, item: Verdict | Exception) -> None:
        """Add a report (any thread); dropped once the router has closed this inbox."""
        with self._lock:
            if self._closed:
                return
            self._items.append(Event(post_id, item))
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set_result(None)

    def report(self, item: Verdict | Exception) -> None:
        """A step the session took alone, or the error that stopped it (its sink)."""
        self.push(None, item)

    def answer(self, post_id: int, future: Future[Verdict]) -> None:
        """Push the outcome of a posted block's `future` once it has one."""

        def answered(done: Future[Verdict]) -> None:
            error = done.exception()
            self.push(post_id, done.result() if error is None else _as_exception(error))

        future.add_done_callback(answered)

    def ready(self) -> Future[None]:
        """A future done once a report is waiting (at once if one is)."""
        with self._lock:
            if self._items or self._closed:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            if self._waiter is None:
                self._waiter = Future()
            return self._waiter

    def waiting(self) -> bool:
        """Whether a report is waiting (what `ready()` tells, without making a future)."""
        with self._lock:
            return bool(self._items or self._closed)

    def take(self) -> list[Event]:
        """Every report waiting, oldest first (none: an empty list)."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def close(self) -> None:
        """The router reads no more: later reports are dropped."""
        with self._lock:
            self._closed = True
            self._items.clear()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set_result(None)


def _as_exception(error: BaseException) -> Exception:
    return error if isinstance(error, Exception) else RuntimeError(str(error))
