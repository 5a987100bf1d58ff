"""The router's end of a Frames stream: many sessions' calls to one replica over one stream.

`FrameChannel` runs one long-lived bidirectional gRPC stream (`rpc Frames`,
`protos/replica.proto`; docs/architecture.md, "Frame stream") over one `grpc.Channel` to one
service (the drafter's or the verifier's). `submit(entry)` gives the entry a tag, queues it and
returns a future of its answer; `send(entry, deliver)` hands the answer to a callback instead,
and with `stays` every later result under the entry's tag too (a running verifier session's
own steps, reported under its open entry's tag) until `release(tag)`. The stream's request
iterator blocks until entries are pending, then yields ONE `RouterFrame` holding all of them
(more only past `MAX_FRAME_BYTES`, `cluster.wire.frame_budget`): gRPC pulls the next frame only
once the previous one is sent, so entries that arrive meanwhile leave together; batching comes from
load, never from a timer. A receiver thread reads the replica's `ReplicaFrame`s and resolves
each future by its tag: the response message, or the `TandemError` its `EntryError` names
(`cluster.wire.status.error_from_entry`). A caller that stops waiting (`forget`: its timeout
or its request's deadline passed) has a `cancel` entry sent for its entry, so that the replica
drops the work instead of running it for nobody.

If the stream fails or ends (the replica died or stopped: UNAVAILABLE; a wrong secret:
UNAUTHENTICATED...), every pending future fails with the matching error
(`cluster.wire.status.error_from_rpc`: `ReplicaUnavailableError` naming the replica for a
transport failure) and the next `submit` opens a new stream. The cluster's secret travels as
the stream's metadata. Threads: one receiver of ours and gRPC's one request consumer per
stream, whatever the number of sessions. `close` ends the stream and joins the receiver.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import grpc

from cluster.runtime.errors import ReplicaUnavailableError, TandemError
from cluster.wire.frame_budget import split_by_size
from cluster.wire.requests import FRAME_VERSION
from cluster.wire.status import error_from_entry, error_from_rpc
from protos import replica_pb2

JOIN_S = 5.0
"""How long `close` waits for the receiver thread."""


class FrameChannel:
    """Calls to one replica service over one Frames stream at a time (see the module doc)."""

    def __init__(
        self,
        channel: grpc.Channel,
        service: str,
        replica: str,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        """`service`: the full service name ("tandem.v1.Verifier"); `replica` names the replica
        in errors ("verifier at host:port"); `metadata`: sent when each stream opens (the
        cluster's secret)."""
        self._frames = channel.stream_stream(
            f"/{service}/Frames",
            request_serializer=replica_pb2.RouterFrame.SerializeToString,
            response_deserializer=replica_pb2.ReplicaFrame.FromString,
        )
        self._replica = replica
        self._metadata = tuple(metadata) if metadata else None
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._tags = itertools.count(1)
        self._closed = False
        self.heard_at = -math.inf
        """When a frame last came from the replica on any of this channel's streams
        (`time.monotonic()`): its liveness (`cluster.routing.liveness`)."""

    def submit(self, entry: replica_pb2.FrameEntry) -> Future[Any]:
        """Send `entry` (its `call` set; its tag is given here) with the next frame; a future of
        the answer's message (`OpenSessionResponse`, `DraftBlock`, `Verdict`,
        `CloseSessionResponse`) or of the error the replica or the stream failed it with."""
        future: Future[Any] = Future()
        self.send(entry, partial(settle, future))
        return future

    def send(self, entry: replica_pb2.FrameEntry, deliver: Deliver, *, stays: bool = False) -> int:
        """Send `entry` with the next frame and hand its answer to `deliver` (the message, or
        the `TandemError` the replica or the stream failed it with), on the receiver thread;
        with `stays`, every later result under its tag too, until `release(tag)` or the
        stream's end (delivered as its error). Returns the entry's tag."""
        with self._lock:
            if self._closed:
                deliver(ReplicaUnavailableError(f"{self._replica}: the client is closed"))
                return 0
            if self._stream is None or self._stream.ended:
                self._stream = _Stream(
                    self._frames, self._replica, self._metadata, self._note_heard
                )
            entry.tag = tag = next(self._tags)
            stream = self._stream
        stream.send(entry, deliver, stays)
        return tag

    def _note_heard(self) -> None:
        self.heard_at = time.monotonic()

    def release(self, tag: int) -> None:
        """Deliver nothing more under `tag` (a running session its router closed)."""
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.release(tag)

    def forget(self, tag: int) -> None:
        """Stop waiting for entry `tag` (its caller gave up): an answer to it is dropped, and
        the replica is told to drop the entry's work if it has not run it yet (a `cancel`
        entry in the next frame)."""
        with self._lock:
            stream = self._stream
            cancel_tag = next(self._tags)
        if stream is not None:
            stream.forget(tag, cancel_tag)

    def close(self) -> None:
        """End the stream (pending futures fail) and join its receiver; submits then fail."""
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


class _Stream:
    """One bidirectional call: the frames out, the receiver thread, the pending futures."""

    def __init__(
        self,
        frames: Callable[..., Any],
        replica: str,
        metadata: tuple[tuple[str, str], ...] | None,
        heard: Callable[[], None] = lambda: None,
    ) -> None:
        """`heard()` is called on every frame received."""
        self._replica = replica
        self._heard = heard
        self._condition = threading.Condition()
        self._queue: list[replica_pb2.FrameEntry] = []
        self._pending: dict[int, tuple[Deliver, bool]] = {}
        """Per unanswered tag, where its answer goes and whether the tag stays for more."""
        self._ending = False
        self.ended = False
        """The call has ended: nothing more is answered (read under the channel's lock)."""
        self._failure: Callable[[], TandemError] = self._gone_error
        """Makes the error the call ended with (one per future: each is raised in its own
        thread)."""
        self._call = frames(self._outgoing(), metadata=metadata)
        self._receiver = threading.Thread(
            target=self._receive, name=f"frames-{replica}", daemon=True
        )
        self._receiver.start()

    def send(self, entry: replica_pb2.FrameEntry, deliver: Deliver, stays: bool) -> None:
        with self._condition:
            ended = self.ended
            if not ended:
                self._pending[entry.tag] = (deliver, stays)
                self._queue.append(entry)
                self._condition.notify()
        if ended:  # it ended as it opened (a refused secret): the same error
            deliver(self._failure())

    def release(self, tag: int) -> None:
        with self._condition:
            self._pending.pop(tag, None)

    def forget(self, tag: int, cancel_tag: int) -> None:
        with self._condition:
            if self._pending.pop(tag, None) is not None and not self.ended:
                # Never answered: `cancel_tag` only keeps tags unique.
                cancel = replica_pb2.CancelEntry(tag=tag)
                self._queue.append(replica_pb2.FrameEntry(tag=cancel_tag, cancel=cancel))
                self._condition.notify()

    def close(self) -> None:
        with self._condition:
            self._ending = True
            self._condition.notify()
        self._call.cancel()
        self._receiver.join(JOIN_S)

    def _outgoing(self) -> Iterator[replica_pb2.RouterFrame]:
        """gRPC's request iterator: blocks until entries are pending, then all of them in one
        frame (gRPC asks for the next frame once the last one is sent)."""
        while True:
            with self._condition:
                while not self._queue and not self._ending:
                    self._condition.wait()
                if self._ending:
                    return
                entries, self._queue = self._queue, []
            for group in split_by_size(entries):
                yield replica_pb2.RouterFrame(version=FRAME_VERSION, entries=group)

    def _receive(self) -> None:
        failure: Callable[[], TandemError]
        try:
            for frame in self._call:
                self._heard()
                if frame.version != FRAME_VERSION:
                    self._call.cancel()
                    message = f"{self._replica}: frame version {frame.version} is not supported"
                    failure = partial(ReplicaUnavailableError, message)
                    break
                for result in frame.results:
                    self._resolve(result)
            else:
                failure = self._gone_error
        except grpc.RpcError as error:
            failure = partial(error_from_rpc, error, self._replica)
        except BaseException:  # never leave a future waiting
            failure = self._gone_error
        with self._condition:
            self.ended = self._ending = True
            self._failure = failure
            pending, self._pending = self._pending, {}
            self._condition.notify()
        for deliver, _ in pending.values():
            deliver(failure())  # one error each: raised in many threads

    def _resolve(self, result: replica_pb2.FrameResult) -> None:
        with self._condition:
            waiting = self._pending.get(result.tag)
            if waiting is None:
                return  # its caller gave up (`forget`, `release`)
            deliver, stays = waiting
            if not stays:
                del self._pending[result.tag]
        kind = result.WhichOneof("result")
        if kind == "error":
            if stays:  # nothing more comes under it
                with self._condition:
                    self._pending.pop(result.tag, None)
            deliver(error_from_entry(result.error, self._replica))
        elif kind is None:
            deliver(ReplicaUnavailableError(f"{self._replica}: a frame result carried nothing"))
        else:
            deliver(getattr(result, kind))

    def _gone_error(self) -> TandemError:
        return ReplicaUnavailableError(f"{self._replica}: the frame stream ended")


Deliver = Callable[[Any], None]
"""Where an entry's answer goes: a response message, or the `TandemError` it failed with."""


def settle(future: Future[Any], answer: Any) -> None:
    """An entry's answer into its future: the message, or the error it failed with."""
    if isinstance(answer, TandemError):
        future.set_exception(answer)
    else:
        future.set_result(answer)
