"""What one Frames stream may hold is bounded (`cluster.replica.stream_limits`, `StreamLimits`):

- a frame with more entries than `MAX_FRAME_ENTRIES` ends its stream with INVALID_ARGUMENT
  naming the limit, before any of its entries is read (and over gRPC, only that stream);
- an entry read while the stream has `MAX_PENDING_ENTRIES` unanswered is refused alone with
  RESOURCE_EXHAUSTED naming the limit, and the stream reads on: room comes back as entries
  are answered, and cancels take none;
- the frames waiting for the transport hold at most `MAX_UNSENT_RESULTS` results: a router
  that reads nothing has its call cancelled and the frames dropped, one that reads is never
  cut off however much it is sent in all;
- a router's own traffic, twice what it may have pending for every session a replica holds by
  default, is nowhere near the limits.

Streams are driven without gRPC over an engine with no steps (every result leaves at once)
and handlers whose answers the test gives; one test sends the oversized frame over gRPC to a
real verifier, then serves a session on a fresh stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NoReturn

import grpc
import pytest

from cluster.replica.frames import EntryHandler, FrameCounters, FrameStream
from cluster.replica.outgoing_frames import END, OutgoingFrames
from cluster.replica.servicer import SessionServicer
from cluster.replica.stream_limits import MAX_FRAME_ENTRIES, MAX_PENDING_ENTRIES, StreamLimits
from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.limits import DEFAULT_MAX_SESSIONS
from cluster.runtime.models import LoadedModel
from cluster.runtime.session import ReplicaStats
from protos import replica_pb2
from tests.cluster.replica.test_frames import (
    AUTH,
    Served,
    assert_serves,
    close_entry,
    serving,
)
from tests.replicas import WAIT_S, RawStream, frame


class NoSteps:
    """A `StepSource` that never steps: results leave with the frame read, or at once."""

    on_engine_thread = False

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        pass

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        pass


class Held:
    """Entry handlers whose answers wait until the test gives them (`answer`)."""

    def __init__(self) -> None:
        self.futures: list[Future[bool]] = []

    def submit(self, request: Any) -> Future[bool]:
        future: Future[bool] = Future()
        self.futures.append(future)
        return future

    def handlers(self) -> dict[str, EntryHandler]:
        handler = EntryHandler(self.submit, closed)
        return {kind: handler for kind in ("open", "draft", "verify", "close")}

    def answer(self, count: int) -> None:
        """Answer the first `count` entries not answered yet."""
        for future in [f for f in self.futures if not f.done()][:count]:
            future.set_result(True)


def closed(existed: bool) -> replica_pb2.FrameResult:
    return replica_pb2.FrameResult(closed=replica_pb2.CloseSessionResponse(existed=existed))


class Sent:
    """What a stream sent: its frames, and whether it ended."""

    def __init__(self) -> None:
        self.frames: list[replica_pb2.ReplicaFrame] = []
        self.ended = False

    def __call__(self, sent: replica_pb2.ReplicaFrame | None) -> None:
        if sent is END:
            self.ended = True
        else:
            assert not self.ended, "a frame after the end"
            self.frames.append(sent)

    def results(self) -> dict[int, replica_pb2.FrameResult]:
        return {result.tag: result for sent in self.frames for result in sent.results}


def closes(tags: range) -> list[replica_pb2.FrameEntry]:
    return [close_entry(tag, f"s{tag}") for tag in tags]


def cancel(tag: int, of: int) -> replica_pb2.FrameEntry:
    return replica_pb2.FrameEntry(tag=tag, cancel=replica_pb2.CancelEntry(tag=of))


DEFAULT_LIMITS = StreamLimits()


def held_stream(
    limits: StreamLimits = DEFAULT_LIMITS,
) -> tuple[FrameStream, Held, Sent, FrameCounters]:
    held, sent, counters = Held(), Sent(), FrameCounters()
    stream = FrameStream(NoSteps(), held.handlers(), sent, counters, "Verifier", limits)
    return stream, held, sent, counters


# Entries in one frame.


def test_a_frame_over_the_entry_limit_ends_its_stream_before_any_entry_is_read() -> None:
    stream, held, sent, counters = held_stream(StreamLimits(frame_entries=4))
    with pytest.raises(
        InvalidArgumentError, match=r"at most 4 entries \(MAX_FRAME_ENTRIES\), got 5"
    ):
        stream.receive(frame(*closes(range(1, 6))))
    assert held.futures == [] and sent.frames == []  # nothing submitted, nothing answered
    assert counters.entries_received == 0
    stream.receive(frame(*closes(range(6, 10))))  # exactly the limit: every entry submitted
    assert len(held.futures) == 4 and sent.frames == []


def test_the_entry_limit_is_max_frame_entries() -> None:
    stream, _, sent, _ = held_stream()
    no_calls = [replica_pb2.FrameEntry(tag=tag) for tag in range(1, MAX_FRAME_ENTRIES + 2)]
    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_FRAME_ENTRIES} entries"):
        stream.receive(frame(*no_calls))
    assert sent.frames == []
    # At the limit the frame is read: each entry is refused alone (it carries no call).
    stream.receive(frame(*no_calls[:MAX_FRAME_ENTRIES]))
    results = sent.results()
    assert len(results) == MAX_FRAME_ENTRIES
    assert {result.error.status for result in results.values()} == {"INVALID_ARGUMENT"}


@pytest.fixture(scope="module")
def served(tiny_target: LoadedModel) -> Iterator[Served]:
    yield from serving(tiny_target)


def test_over_grpc_a_frame_over_the_limit_ends_only_its_stream(served: Served) -> None:
    stream = RawStream(served.address, metadata=AUTH)
    try:
        stream.send(frame(*closes(range(1, MAX_FRAME_ENTRIES + 2))))
        code, details = stream.status()
    finally:
        stream.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_FRAME_ENTRIES} entries" in details
    assert stream.unread() == []  # not one of its entries was answered
    assert_serves(served, "after-a-long-frame")


# Entries pending on one stream.


def test_entries_beyond_the_pending_limit_are_refused_alone_and_the_stream_reads_on() -> None:
    stream, held, sent, _ = held_stream(StreamLimits(pending_entries=3))
    stream.receive(frame(*closes(range(1, 6))))
    assert len(held.futures) == 3  # entries 1-3 submitted; 4 and 5 refused as they were read
    refused = sent.results()
    assert set(refused) == {4, 5}
    for result in refused.values():
        assert result.error.status == "RESOURCE_EXHAUSTED"
        assert "3 entries pending" in result.error.message
        assert "MAX_PENDING_ENTRIES" in result.error.message
    # A cancel takes no room (and is never answered); an answer gives one back.
    stream.receive(frame(cancel(6, of=1)))
    held.answer(1)
    stream.receive(frame(*closes(range(7, 9))))
    assert len(held.futures) == 4  # entry 7 submitted, 8 refused
    assert sent.results()[1].closed.existed
    assert sent.results()[8].error.status == "RESOURCE_EXHAUSTED"
    assert 6 not in sent.results() and 7 not in sent.results()
    # Refused entries were never pending: once the rest are answered, the stream ends.
    stream.half_close()
    assert not sent.ended
    held.answer(3)
    assert sent.ended
    assert set(sent.results()) == {1, 2, 3, 4, 5, 7, 8}


def test_the_pending_limit_is_max_pending_entries() -> None:
    stream, held, sent, _ = held_stream()
    tags = range(1, MAX_PENDING_ENTRIES + 2)
    for start in range(0, len(tags), MAX_FRAME_ENTRIES):
        stream.receive(frame(*closes(tags[start : start + MAX_FRAME_ENTRIES])))
    assert len(held.futures) == MAX_PENDING_ENTRIES
    [(tag, result)] = sent.results().items()
    assert tag == MAX_PENDING_ENTRIES + 1 and result.error.status == "RESOURCE_EXHAUSTED"
    assert f"{MAX_PENDING_ENTRIES} entries pending" in result.error.message


ROUTER_CALLS = ("open", "draft", "verify", "verify", "close")
"""The most calls a router has pending per session on a replica at once (an open or a close, a
draft call or two posted blocks: more than it ever has, each kind counted)."""


def test_twice_a_routers_most_for_every_session_is_far_inside_the_limits() -> None:
    # Every session a replica holds by default, each with every call a router may have pending
    # and a cancel for each but one: one frame of them, then another (twice the most), all held.
    stream, held, sent, _ = held_stream()
    sessions = DEFAULT_MAX_SESSIONS
    tags = iter(range(1, 1_000_000))
    for _ in range(2):
        entries = []
        for session in range(sessions):
            calls = [
                replica_pb2.FrameEntry(tag=next(tags), **{kind: {"session_id": f"s{session}"}})
                for kind in ROUTER_CALLS
            ]
            entries += calls + [cancel(next(tags), of=call.tag) for call in calls[1:]]
        assert len(entries) <= MAX_FRAME_ENTRIES // 3
        stream.receive(frame(*entries))
    pending = 2 * sessions * len(ROUTER_CALLS)
    assert len(held.futures) == pending and pending <= MAX_PENDING_ENTRIES // 3
    assert sent.frames == []  # not one refused


# Results the router has not read.


def test_a_router_that_reads_as_frames_come_is_never_cut_off() -> None:
    overflows: list[None] = []
    outgoing = OutgoingFrames(4, overflowed=lambda: overflows.append(None))
    for tag in range(100):  # 300 results in all, 3 at a time
        outgoing.put(replica_pb2.ReplicaFrame(results=[{"tag": tag}] * 3))
        taken = outgoing.get()
        assert isinstance(taken, replica_pb2.ReplicaFrame) and taken.results[0].tag == tag
    outgoing.put(END)
    assert outgoing.get() is END and overflows == [] and outgoing.unsent == 0


def test_past_the_unsent_limit_the_stream_ends_and_its_frames_are_dropped() -> None:
    overflows: list[None] = []
    outgoing = OutgoingFrames(8, overflowed=lambda: overflows.append(None))
    for _ in range(2):
        outgoing.put(replica_pb2.ReplicaFrame(results=[{"tag": 1}] * 3))
    assert outgoing.unsent == 6 and overflows == []
    outgoing.put(replica_pb2.ReplicaFrame(results=[{"tag": 1}] * 3))  # 9 > 8
    assert overflows == [None] and outgoing.unsent == 0  # the queued frames are dropped
    # Nothing more is queued: not a frame, not the end.
    outgoing.put(replica_pb2.ReplicaFrame(results=[{"tag": 2}]))
    outgoing.put(END)
    error = outgoing.get()
    assert isinstance(error, ResourceExhaustedError)
    assert "more than 8 results unread (MAX_UNSENT_RESULTS)" in str(error)
    assert outgoing.unsent == 0 and overflows == [None]


class Answered:
    """A component whose close entries are answered as they are read (no steps)."""

    engine = NoSteps()

    def close_session(self, session_id: str) -> bool:
        return True

    def submit_open(self, *args: Any, **kwargs: Any) -> Future[int]:
        raise NotImplementedError

    def submit_close(self, session_id: str) -> Future[bool]:
        future: Future[bool] = Future()
        future.set_result(True)
        return future

    def stats(self) -> ReplicaStats:
        raise NotImplementedError


class Aborted(Exception):
    pass


class Context:
    """The servicer context of one Frames call, without gRPC: cancel and abort are recorded."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)


FRAMES = 10
CLOSES = 4
"""Each router frame: CLOSES close entries, answered in one replica frame of as many results."""


def router(taken: threading.Semaphore, paced: int, done: threading.Event) -> Iterator[Any]:
    """FRAMES frames of CLOSES closes, each of the first `paced` after them once the answer to
    the one before was taken (`taken` released); `done` set once every frame was read."""
    for index in range(FRAMES):
        if 0 < index <= paced:
            assert taken.acquire(timeout=WAIT_S)
        yield frame(*closes(range(1 + index * CLOSES, 1 + (index + 1) * CLOSES)))
    done.set()


def frames_call(router_frames: Iterator[Any], context: Context) -> Iterator[Any]:
    servicer: SessionServicer[Any] = SessionServicer(Answered(), "Verifier")
    servicer.stream_limits = StreamLimits(unsent_results=4 * CLOSES)
    return servicer.Frames(router_frames, context)


def test_a_router_that_reads_nothing_has_its_call_cancelled() -> None:
    context, done, taken = Context(), threading.Event(), threading.Semaphore(0)
    call = frames_call(router(taken, 1, done), context)
    assert len(next(call).results) == CLOSES  # the transport took one frame, then nothing
    taken.release()
    assert done.wait(WAIT_S)  # every frame read and answered meanwhile
    # 9 frames of 4 results made for 16 of room: the 5th past it ended the stream.
    assert context.cancelled.is_set()
    with pytest.raises(Aborted) as aborted:
        next(call)  # not a frame: they were dropped
    code, details = aborted.value.args
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "more than 16 results" in details


def test_a_router_that_reads_gets_every_frame_however_many() -> None:
    context, done, taken = Context(), threading.Event(), threading.Semaphore(0)
    call = frames_call(router(taken, FRAMES, done), context)
    tags = []
    for sent in call:  # 40 results in all, 2.5 times the room, never more than 4 unread
        tags += [result.tag for result in sent.results]
        taken.release()
    assert tags == list(range(1, FRAMES * CLOSES + 1))
    assert done.is_set() and not context.cancelled.is_set()
