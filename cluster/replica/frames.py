"""One Frames stream served: RouterFrames in, one ReplicaFrame per engine step out.

A router keeps one long-lived bidirectional stream to each replica it uses (`rpc Frames` in
`protos/replica.proto`; docs/architecture.md, "Frame stream"). Each `RouterFrame` holds the
work the router had pending for any number of sessions; `FrameStream.receive` reads each of
its entries with `cluster.wire.requests` and submits it to the component (its future-returning
calls, `submit_open`, `submit_draft`...) inside `call_scope(gone)`, so that the engine drops
whatever work the stream leaves behind once it ends. Results gather in an outbox as their
futures complete; the engine's step listener flushes the outbox as ONE `ReplicaFrame` at the
end of each step, so everything a step produced for this router leaves in one message (or
several, each under `MAX_FRAME_BYTES`: `cluster.wire.frame_budget`).
Results that complete off the engine thread (an entry refused when read, before any step) go
out when the frame that brought them has been read, together.

Cancelling: an entry `cancel` (the tag of an earlier entry) gives that entry up. Each entry is
submitted in a `call_scope` of its own (`_EntryGone`), set by its cancel or by the stream's
end, so the engine drops its work before its next step; its result, if it still has one, is a
CANCELLED error the router no longer waits for. A cancel is never answered.

Errors are per entry: an entry's failure becomes its `FrameResult.error` (the `TandemError`'s
status name and message, its retry hint; anything unexpected INTERNAL with a fixed message,
logged, as `CallGuard` does) and the stream and the other sessions carry on. A frame of another
layout version is the stream's error (`InvalidArgumentError` out of `receive`: the adapter ends
the stream with INVALID_ARGUMENT). Entries of one session keep their order: the engine runs the
tasks of one key in submission order.

Bounds (`StreamLimits`; each a module constant that says why its value). The replica's server
counts a stream as one call however much its frames bring, so the stream bounds that itself:

- entries in one frame, `MAX_FRAME_ENTRIES`: a frame with more is the stream's error
  (`InvalidArgumentError`, INVALID_ARGUMENT, naming the limit), refused before any of its
  entries is read, like a frame of another version: refusing each entry instead would still
  cost a result per entry, millions of them for one 64 MiB frame of empty entries.
- entries pending (submitted and not answered yet), `MAX_PENDING_ENTRIES`: an entry read
  beyond it is refused alone, RESOURCE_EXHAUSTED naming the limit, and the stream reads on.
  Refusing rather than not reading further frames (backpressure) because the frames the
  stream would stop reading also carry the cancels and closes that drain the work; because a
  router held back batches what it holds into larger frames, towards `MAX_FRAME_ENTRIES`; and
  because errors are per entry everywhere else on the stream.
- results its router has not read yet, `MAX_UNSENT_RESULTS` (`OutgoingFrames`, the queue
  between `send` and the transport): a router that leaves more unread ends its stream. Not
  bounded by the pending limit: a running session's own steps report on without any entry
  pending; and the producer cannot wait for the router (see `OutgoingFrames`).

A plain class over an `Engine`, the entry handlers and a `send` callback: no gRPC here (the
servicer's `Frames` handler is the adapter: `cluster.replica.servicer`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

from cluster.runtime.call_scope import call_scope
from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError, TandemError
from cluster.runtime.limits import DEFAULT_MAX_SESSIONS
from cluster.runtime.session import ReplicaStats
from cluster.wire.frame_budget import split_by_size
from cluster.wire.requests import FRAME_VERSION
from cluster.wire.status import entry_error
from protos import replica_pb2

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error; see the replica's log"
"""The only details a router gets for an unexpected failure of an entry (as `CallGuard`)."""

MAX_PENDING_ENTRIES = 32 * DEFAULT_MAX_SESSIONS
"""Entries one stream may have submitted and not yet answered (8192); one more is refused with
RESOURCE_EXHAUSTED. A router has at most 4 entries pending per session on a replica (an open or
a close, a draft call or up to two posted blocks: docs/architecture.md, "Ordering"), for at
most the sessions it runs (`max_running_requests`, 64 by default) and never usefully more than
a replica holds (`max_sessions`, `DEFAULT_MAX_SESSIONS` = 256 by default): 256 sessions' 1024
entries are an eighth of it; it takes 2048 sessions on one stream to reach it. At the limit a
stream holds 8192 futures and tasks: some megabytes, not the replica's memory."""

MAX_FRAME_ENTRIES = MAX_PENDING_ENTRIES
"""Entries one `RouterFrame` may carry (8192); a frame with more ends its stream with
INVALID_ARGUMENT. A router's frame is whatever it has pending for the replica when gRPC takes
the next one: at most the pending entries above plus the cancels of entries it gave up (one per
entry at most), 8 a session, so 2048 for 256 sessions, a quarter of the limit. A frame that
alone would fill the pending limit is no router's; and the limit caps what one frame of empty
entries (4 bytes each: 16 million within the 64 MiB message limit) can make the stream do."""

MAX_UNSENT_RESULTS = 8 * MAX_FRAME_ENTRIES
"""Results a stream may have made that its router has not read (65536); one more ends the
stream (`OutgoingFrames`). A router's receiver reads each frame as it comes, so results wait
only while the transport is behind or the router stalls: at 256 running sessions and 100
steps a second (a GPU's small-batch decode) this is 2.5 s of steps unread, 10 s at 64 sessions;
and it is 8 times what one frame's entries can be answered with. About 200 bytes a result
(one-token verdicts), some 13 MB at the limit."""


@dataclass(frozen=True)
class StreamLimits:
    """What one Frames stream may hold (see the module docstring); the defaults are the module's
    constants, which tests narrow."""

    frame_entries: int = MAX_FRAME_ENTRIES
    pending_entries: int = MAX_PENDING_ENTRIES
    unsent_results: int = MAX_UNSENT_RESULTS


def check_frame(frame: replica_pb2.RouterFrame, limits: StreamLimits) -> None:
    """Raise `InvalidArgumentError` for a frame its stream must end on: one of another layout
    version, or with more than `limits.frame_entries` entries (naming the limit)."""
    if frame.version != FRAME_VERSION:
        raise InvalidArgumentError(
            f"frame version {frame.version} is not supported (this replica speaks "
            f"version {FRAME_VERSION})"
        )
    if len(frame.entries) > limits.frame_entries:
        raise InvalidArgumentError(
            f"a frame carries at most {limits.frame_entries} entries (MAX_FRAME_ENTRIES), "
            f"got {len(frame.entries)}"
        )


def pending_limit_error(limits: StreamLimits) -> ResourceExhaustedError:
    """An entry's refusal when its stream already has `limits.pending_entries` pending."""
    return ResourceExhaustedError(
        f"this stream already has {limits.pending_entries} entries pending, the most it may "
        "have (MAX_PENDING_ENTRIES); send more once they are answered"
    )


@dataclass(frozen=True)
class EntryHandler:
    """How a replica serves one kind of `FrameEntry` (the field set in its `call` oneof)."""

    submit: Callable[..., Future[Any]]
    """The entry's request message -> a future of the component's answer; may raise (a
    request that does not convert), which fails the entry alone."""
    answer: Callable[[Any], replica_pb2.FrameResult]
    """The component's answer as a `FrameResult` (its tag is set by the stream)."""
    reported: Callable[[Any], replica_pb2.FrameResult] | None = None
    """For an entry whose work reports on after its answer (a running verifier session's own
    steps): how each report becomes a `FrameResult` under the entry's tag. `submit` is then
    also given `report=`, the callback to report with (a value, or the error that ended
    the reports); None: the entry is answered once."""


class FrameCounters:
    """Frames and their entries/results since start, over every stream of a replica (any
    thread may count; `ReplicaStats` reports them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.frames_sent = 0
        self.results_sent = 0
        self.frames_received = 0
        self.entries_received = 0

    def sent(self, results: int) -> None:
        with self._lock:
            self.frames_sent += 1
            self.results_sent += results

    def received(self, entries: int) -> None:
        with self._lock:
            self.frames_received += 1
            self.entries_received += entries

    def add_to(self, stats: ReplicaStats) -> ReplicaStats:
        """`stats` with these counts."""
        with self._lock:
            return replace(
                stats,
                frames_sent=self.frames_sent,
                results_sent=self.results_sent,
                frames_received=self.frames_received,
                entries_received=self.entries_received,
            )


END = None
"""What `send` is given once the stream has nothing more to send (see `FrameStream`)."""


class StepSource(Protocol):
    """What a stream needs of the component's engine (`cluster.runtime.engine.Engine`): to be
    told when each step ends, and whether a result completed on its thread. A component with
    no steps (the suffix drafter answers as it reads) never calls the listener and is never
    on an engine thread: every result then leaves with the frame that brought it."""

    @property
    def on_engine_thread(self) -> bool: ...

    def add_step_listener(self, listener: Callable[[], None]) -> None: ...

    def remove_step_listener(self, listener: Callable[[], None]) -> None: ...


class FrameStream:
    """Serves one Frames stream over a component's engine (see the module docstring).

    `send(frame)` hands a `ReplicaFrame` to the transport (any thread, the engine's included:
    it must not wait; frames in the order given), and `send(END)` once the router has
    half-closed and every entry is answered. `handlers` by entry kind ("open", "draft",
    "verify", "close"): a kind missing is refused per entry (a drafter serves no verify
    entries, a verifier no draft entries). `name` names the component in the log of an
    unexpected failure. `limits`: entries per frame and pending (`StreamLimits`; the bound on
    unsent results is the transport queue's, `OutgoingFrames`).
    """

    def __init__(
        self,
        engine: StepSource,
        handlers: Mapping[str, EntryHandler],
        send: Callable[[replica_pb2.ReplicaFrame | None], None],
        counters: FrameCounters,
        name: str,
        limits: StreamLimits = StreamLimits(),
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._handlers = handlers
        self._send = send
        self._counters = counters
        self._name = name
        self.gone = threading.Event()
        """Set when the stream ends: the engine drops the work it left (`call_scope`)."""
        self._lock = threading.Lock()
        self._given_up: dict[int, _EntryGone] = {}
        """Per unanswered entry, by tag: its scope, which the router's cancel sets."""
        self._outbox: list[replica_pb2.FrameResult] = []
        """Results waiting for the end of the engine's step."""
        self._reading: list[replica_pb2.FrameResult] | None = None
        """While `receive` runs: results completed on its thread, sent when it returns."""
        self._reader: threading.Thread | None = None
        self._pending = 0
        """Entries submitted and not yet answered (at most `limits.pending_entries`)."""
        self._half_closed = False
        self._ended = False
        engine.add_step_listener(self.flush)

    def receive(self, frame: replica_pb2.RouterFrame) -> None:
        """Submit every entry of `frame` (one beyond the pending limit is refused alone);
        raises `InvalidArgumentError` for a frame of an unknown version or with more entries
        than the limit (`check_frame`: the stream's error, nothing of it is submitted)."""
        check_frame(frame, self._limits)
        self._counters.received(len(frame.entries))
        with self._lock:
            self._reader, self._reading = threading.current_thread(), []
        try:
            for entry in frame.entries:
                if entry.HasField("cancel"):
                    self._cancel(entry.cancel.tag)
                else:
                    self._submit(entry)
        finally:
            with self._lock:
                ready, self._reader, self._reading = self._reading or [], None, None
            self._emit(ready)

    def half_close(self) -> None:
        """The router sends no more: end the stream once every entry is answered."""
        with self._lock:
            self._half_closed = True
        self._emit([])

    def close(self) -> None:
        """The stream has ended: stop sending, and let the engine drop what is left of it."""
        self.gone.set()
        self._engine.remove_step_listener(self.flush)
        with self._lock:
            self._ended = True
            self._outbox.clear()
            self._given_up.clear()  # each entry's scope reads `gone` too

    def _cancel(self, tag: int) -> None:
        """The router gave up entry `tag`: the engine drops its work before its next step (a
        task already computing finishes that step). Unknown or answered tags are ignored."""
        with self._lock:
            scope = self._given_up.get(tag)
        if scope is not None:
            scope.cancelled = True

    def flush(self) -> None:
        """Send the results gathered so far as one frame (the engine's step listener)."""
        with self._lock:
            ready, self._outbox = self._outbox, []
        self._emit(ready)

    def _submit(self, entry: replica_pb2.FrameEntry) -> None:
        """Submit `entry` to its handler, or refuse it alone: no call, a kind this component
        does not serve, or the stream's pending limit reached."""
        kind = entry.WhichOneof("call")
        handler = self._handlers.get(kind) if kind is not None else None
        if handler is None:
            refusal = (
                "a frame entry must carry a call"
                if kind is None
                else f"the {self._name.lower()} serves no {kind} entries"
            )
            self._refuse(entry.tag, InvalidArgumentError(refusal))
            return
        given_up = _EntryGone(self.gone)
        with self._lock:
            full = self._pending >= self._limits.pending_entries
            if not full:
                self._pending += 1
                self._given_up[entry.tag] = given_up
        if full:
            self._refuse(entry.tag, pending_limit_error(self._limits))
            return
        request = getattr(entry, kind)
        try:
            with call_scope(given_up):
                if handler.reported is None:
                    future = handler.submit(request)
                else:
                    report = partial(self._report, entry.tag, handler.reported)
                    future = handler.submit(request, report=report)
        except Exception as error:  # the entry alone fails; the stream goes on
            future = _failed(error)
        future.add_done_callback(partial(self._done, entry.tag, handler))

    def _report(
        self, tag: int, reported: Callable[[Any], replica_pb2.FrameResult], item: Any
    ) -> None:
        """A further result under entry `tag` (a running session's own step, or the error
        that stopped it): sent with the step's frame, like an answer."""
        if isinstance(item, BaseException):
            result = replica_pb2.FrameResult(tag=tag, error=self._error(item))
        else:
            try:
                result = reported(item)
            except Exception as failure:
                result = replica_pb2.FrameResult(error=self._error(failure))
            result.tag = tag
        with self._lock:
            if self._ended:
                return
            self._outbox.append(result)
            now = not self._engine.on_engine_thread  # else the step listener sends it
        if now:
            self.flush()

    def _refuse(self, tag: int, error: TandemError) -> None:
        """Entry `tag` is refused as it is read (it was never pending): its error goes out as
        an answer's would."""
        self._deliver(replica_pb2.FrameResult(tag=tag, error=self._error(error)), answered=None)

    def _done(self, tag: int, handler: EntryHandler, future: Future[Any]) -> None:
        """A submitted entry's future completed: it is no longer pending, and its result goes
        out."""
        self._deliver(self._result(tag, handler, future), answered=tag)

    def _deliver(self, result: replica_pb2.FrameResult, answered: int | None) -> None:
        """Put `result` where the next send picks it up (with the frame being read, if it is
        this thread's; else with the step's frame, or now off the engine's thread).
        `answered`: the tag of the pending entry it answers."""
        with self._lock:
            if answered is not None:
                self._given_up.pop(answered, None)
                self._pending -= 1
            if self._ended:
                return
            if self._reading is not None and threading.current_thread() is self._reader:
                self._reading.append(result)
                return
            self._outbox.append(result)
            now = not self._engine.on_engine_thread  # else the step listener sends it
        if now:
            self.flush()

    def _result(
        self, tag: int, handler: EntryHandler, future: Future[Any]
    ) -> replica_pb2.FrameResult:
        error = future.exception()
        if error is None:
            try:
                result = handler.answer(future.result())
            except Exception as failure:
                error = failure
            else:
                result.tag = tag
                return result
        assert error is not None
        return replica_pb2.FrameResult(tag=tag, error=self._error(error))

    def _error(self, error: BaseException) -> replica_pb2.EntryError:
        """An entry's failure as the router reads it (an unexpected one: INTERNAL, logged)."""
        if isinstance(error, TandemError):
            retry_after_s = getattr(error, "retry_after_s", None)
            return entry_error(error.status, str(error), retry_after_s)
        logger.error("%s frame entry failed unexpectedly", self._name, exc_info=error)
        return entry_error("INTERNAL", INTERNAL_ERROR_MESSAGE)

    def _emit(self, results: list[replica_pb2.FrameResult]) -> None:
        """Send `results` as one frame (none: nothing), then the end once the router has
        half-closed and nothing is pending."""
        with self._lock:
            if self._ended:
                return
            finished = self._half_closed and self._pending == 0 and not self._outbox
            if finished:
                self._ended = True
            # Sent under the lock so that frames leave in the order they were made.
            for group in split_by_size(results):
                self._counters.sent(len(group))
                self._send(replica_pb2.ReplicaFrame(version=FRAME_VERSION, results=group))
            if finished:
                self._send(END)


def unread_limit_error(limit: int) -> ResourceExhaustedError:
    """What ends a stream whose router left more than `limit` results unread."""
    return ResourceExhaustedError(
        f"the router left more than {limit} results unread (MAX_UNSENT_RESULTS): the stream "
        "is ended"
    )


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


class _EntryGone:
    """One entry's `call_scope`: set once the router cancels the entry or its stream ends (a
    flag and the stream's event: nothing to allocate beyond this per entry)."""

    __slots__ = ("_stream", "cancelled")

    def __init__(self, stream: threading.Event) -> None:
        self._stream = stream
        self.cancelled = False

    def is_set(self) -> bool:
        return self.cancelled or self._stream.is_set()


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future
