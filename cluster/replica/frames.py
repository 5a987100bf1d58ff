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
Results that complete off the engine thread (an entry refused when read) go out together once
the frame that brought them has been read.

Cancelling: an entry `cancel` (the tag of an earlier entry) gives that entry up: its own
`call_scope` (`_EntryGone`), set by its cancel or the stream's end, has the engine drop its work
before its next step; its result, if any, is a CANCELLED error no one waits for. A cancel is
never answered.

Errors are per entry: an entry's failure becomes its `FrameResult.error` (the `TandemError`'s
status name and message, its retry hint; anything unexpected INTERNAL with a fixed message,
logged, as `CallGuard` does) and the stream and the other sessions carry on. A frame of another
layout version, or with more entries than its limit, is the stream's error
(`InvalidArgumentError` out of `receive`: the adapter ends the stream with INVALID_ARGUMENT).
Entries of one session keep their order: the engine runs the tasks of one key in submission
order. What a stream may hold: `cluster.replica.stream_limits`; the queue its frames leave by:
`cluster.replica.outgoing_frames`.

A plain class over an engine, entry handlers and a `send` callback: no gRPC (the adapter is
`cluster.replica.servicer`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

from cluster.replica.outgoing_frames import END
from cluster.replica.stream_limits import StreamLimits, check_frame, pending_limit_error
from cluster.runtime.call_scope import call_scope
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.runtime.session import ReplicaStats
from cluster.wire.frame_budget import split_by_size
from cluster.wire.requests import FRAME_VERSION
from cluster.wire.status import entry_error
from protos import replica_pb2

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error; see the replica's log"
"""The only details a router gets for an unexpected failure of an entry (as `CallGuard`)."""


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
