"""A Frames stream's outgoing frames: the bounded queue between the stream and its transport.

Contract: the stream's `send` is `OutgoingFrames.put` (any thread, never waits; `END` once the
stream has nothing more to send), and the transport takes the frames in order with `get`. At
most `limit` results wait in all (`MAX_UNSENT_RESULTS`, `cluster.replica.stream_limits`);
past it the stream ends with a `ResourceExhaustedError` naming the limit, and nothing more is
queued after an END or an error. No gRPC here: the servicer's `Frames` handler drains it
(`cluster.replica.servicer`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from cluster.replica.stream_limits import unread_limit_error
from cluster.runtime.errors import TandemError
from protos import replica_pb2

END = None
"""What `send` is given once the stream has nothing more to send
(`cluster.replica.frames.FrameStream`)."""


class OutgoingFrames:
    """A stream's frames that its transport has not taken yet: at most `limit` results in all
    (besides the one frame the transport is sending).

    The stream's `send` is `put` (any thread; it never waits) and the transport takes the
    frames in order with `get`. Past the limit the stream ends: the frames still queued are
    dropped, `get` returns a `ResourceExhaustedError` naming the limit (the transport ends the
    stream with it), and `overflowed` is called once (the servicer cancels the call: a status
    would only be sent after the frames the router is not reading). After that, an END or an
    error, nothing more is queued.

    Why not backpressure (the producer waiting for room): frames are made on the engine's
    thread, at the end of each step, and that thread steps every stream's sessions, so waiting
    there for one router to read would stall every other router's sessions on the replica.
    Why not a bound that follows from the pending limit: a running session reports each of its
    own steps with no entry pending, until its end, however long the router reads nothing.
    """

    def __init__(self, limit: int, overflowed: Callable[[], None]) -> None:
        self._limit = limit
        self._overflowed = overflowed
        self._condition = threading.Condition()
        self._items: deque[replica_pb2.ReplicaFrame | TandemError | None] = deque()
        self._unsent = 0
        """Results in the frames queued (at most `limit`)."""
        self._closed = False
        """An END or an error is queued: nothing more is."""

    @property
    def unsent(self) -> int:
        """Results in the frames queued now."""
        with self._condition:
            return self._unsent

    def put(self, frame: replica_pb2.ReplicaFrame | None) -> None:
        """Queue `frame` for the transport (`END`: the stream is done once the frames before
        it are sent); past the limit, end the stream instead (see the class docstring)."""
        if frame is END:
            self._close_with(END)
            return
        with self._condition:
            if self._closed:
                return
            over = self._unsent + len(frame.results) > self._limit
            if over:
                self._items.clear()
                self._unsent = 0
                self._items.append(unread_limit_error(self._limit))
                self._closed = True
            else:
                self._items.append(frame)
                self._unsent += len(frame.results)
            self._condition.notify()
        if over:
            self._overflowed()

    def fail(self, error: TandemError) -> None:
        """End the stream with `error` once the frames queued before it are sent."""
        self._close_with(error)

    def get(self) -> replica_pb2.ReplicaFrame | TandemError | None:
        """The next frame to send, waiting for one; an error (end the stream with it) or END
        (end it: done) last."""
        with self._condition:
            while not self._items:
                self._condition.wait()
            item = self._items.popleft()
            if isinstance(item, replica_pb2.ReplicaFrame):
                self._unsent -= len(item.results)
            return item

    def _close_with(self, last: TandemError | None) -> None:
        with self._condition:
            if self._closed:
                return
            self._items.append(last)
            self._closed = True
            self._condition.notify()
