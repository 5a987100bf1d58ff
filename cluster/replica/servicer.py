"""What the drafter's and the verifier's gRPC servicers share: the session RPCs, the Frames stream.

`SessionServicer` serves Stats (under the servicer's `CallGuard`: errors become gRPC statuses)
and the Frames stream, whose open and close entries it serves over a `SessionComponent`: each
entry converted with `cluster.wire.requests`, submitted to the component (calls run
concurrently, batched by the component's engine), its answer converted back. Each side's
servicer (`drafter.servicer`, `verifier.servicer`) adds its own kinds of entry
(`_entry_handlers`: draft and predraft, verify) and says how it registers on a server
(`add_to_server`).

`Frames` is the thin adapter over a `FrameStream` (`cluster.replica.frames`): the router's
frames are read on a thread of their own and handed to the stream, and the stream's frames are
yielded from a bounded queue (`OutgoingFrames`) as the engine's steps produce them. A frame the
stream refuses (an unknown version, more entries than `MAX_FRAME_ENTRIES`) or that is not a
RouterFrame (`ParseCheck`) ends the stream with INVALID_ARGUMENT; a router that leaves more than
`MAX_UNSENT_RESULTS` results unread has its call cancelled (its status could only come after
the frames it is not reading); the other streams and the replica carry on. What one stream
may hold is the servicer's `stream_limits`. Stats reports the frames counted over every stream
(`FrameCounters`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

import grpc

from cluster.replica.frames import EntryHandler, FrameCounters, FrameStream, StepSource
from cluster.replica.outgoing_frames import END, OutgoingFrames
from cluster.replica.rpc import CallGuard
from cluster.replica.stream_limits import StreamLimits
from cluster.runtime.errors import TandemError
from cluster.runtime.session import ReplicaStats
from cluster.wire import requests
from cluster.wire.replica_stats import stats_to_wire
from cluster.wire.status import status_code
from protos import replica_pb2


class ServedComponent(Protocol):
    """What a servicer serves: a `SessionComponent` (drafter, verifier), or a component with
    no engine (`drafter.suffix.SuffixDrafter`) whose servicer brings its own entry handlers."""

    @property
    def engine(self) -> StepSource: ...

    def close_session(self, session_id: str) -> bool: ...

    def submit_open(self, *args: Any, **kwargs: Any) -> Future[int]: ...

    def submit_close(self, session_id: str) -> Future[bool]: ...

    def stats(self) -> ReplicaStats: ...


K = TypeVar("K", bound=ServedComponent)


class SessionServicer(Generic[K]):
    """Serves the session RPCs of one component over gRPC; a side's servicer extends it."""

    def __init__(self, component: K, component_name: str) -> None:
        """`component_name` names the component in the log of an unexpected failure."""
        self.component = component
        self._name = component_name
        self._guard = CallGuard(component_name)
        self.frame_counters = FrameCounters()
        """Frames sent and received over every Frames stream of this servicer."""
        self.stream_limits = StreamLimits()
        """What each Frames stream may hold: entries a frame, entries pending, results its
        router has not read (`cluster.replica.stream_limits`)."""

    def add_to_server(self, server: grpc.Server) -> None:
        """Register this servicer on `server` (what `start_server` takes as `add_servicer`)."""
        raise NotImplementedError

    def Stats(
        self, request: replica_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReplicaStats:
        return self._guard.run(
            context,
            "Stats",
            lambda: stats_to_wire(self.frame_counters.add_to(self.component.stats())),
        )

    def Frames(
        self, request_iterator: Iterator[replica_pb2.RouterFrame], context: grpc.ServicerContext
    ) -> Iterator[replica_pb2.ReplicaFrame]:
        limits = self.stream_limits
        outgoing = OutgoingFrames(limits.unsent_results, overflowed=context.cancel)
        stream = FrameStream(
            self.component.engine,
            self._entry_handlers(),
            outgoing.put,
            self.frame_counters,
            self._name,
            limits,
        )

        def read() -> None:
            try:
                for frame in request_iterator:
                    stream.receive(frame)
            except TandemError as error:  # no RouterFrame, another version, too many entries
                outgoing.fail(error)
                return
            except Exception:  # the call ended under the iterator (cancelled, or aborted)
                outgoing.put(END)
                return
            stream.half_close()

        if not context.add_callback(lambda: outgoing.put(END)):
            stream.close()
            return
        threading.Thread(target=read, name="replica-frames-reader", daemon=True).start()
        try:
            while True:
                item = outgoing.get()
                if item is END:
                    return
                if isinstance(item, TandemError):
                    context.abort(status_code(item.status), str(item))
                else:
                    yield item
        finally:
            stream.close()

    def _entry_handlers(self) -> dict[str, EntryHandler]:
        """How this servicer serves each kind of frame entry; a side adds its own."""
        return {
            "open": EntryHandler(self._submit_open, opened),
            "close": EntryHandler(
                lambda request: self.component.submit_close(
                    requests.close_request_from_wire(request)
                ),
                lambda existed: replica_pb2.FrameResult(
                    closed=replica_pb2.CloseSessionResponse(existed=existed)
                ),
            ),
        }

    def _submit_open(self, request: replica_pb2.OpenSessionRequest) -> Any:
        read = requests.open_request_from_wire(request)
        return self.component.submit_open(
            read.session_id,
            read.prompt_tokens,
            read.sampling,
            read.seed,
            time_limit_s=read.time_limit_s,
            max_new_tokens=read.max_new_tokens,
            resumed=read.resumed,
            constraint=read.constraint,
        )


def opened(length: int) -> replica_pb2.FrameResult:
    return replica_pb2.FrameResult(opened=replica_pb2.OpenSessionResponse(committed_length=length))
