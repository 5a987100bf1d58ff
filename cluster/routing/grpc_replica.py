"""What the router's gRPC replica clients share: `ReplicaClient`, the base of `GrpcDrafter`
(`cluster.routing.grpc_drafter`) and `GrpcVerifier` (`cluster.routing.grpc_verifier`), the
router's ports over the network.

The clients implement `DrafterPort` and `VerifierPort`, so the router runs unchanged over
replicas in other processes (docs/architecture.md, invariant 4: direct gRPC to the pinned
replica, no Serve hop). Each wraps one `grpc.Channel`, given or opened from a "host:port"
address, and converts values with the `cluster.wire` modules.

Every session call (open, draft, predraft, verify, close) is an entry of one long-lived Frames
stream per client (`cluster.routing.frame_channel.FrameChannel`), shared by every `bounded`
view of it, so a router sends one frame per replica for whatever its sessions have pending, not
one call per session (docs/architecture.md, "Frame stream"), and each call yields its waits
(`cluster.routing.waits`) that wait on its entry's answer without a thread. A client is kept per
replica address (`cluster.routing.directory`), so one router process holds one stream per
replica and service. Stats and Reference are unary calls.

Errors: a failed call (or frame entry) raises the `TandemError` subclass the replica raised
(matched by status code, with the replica's message; `cluster.wire.status.error_from_entry`),
so callers handle a remote replica as they would a local one. Codes with no class of their own
(UNAVAILABLE, INTERNAL, ...) raise `ReplicaUnavailableError`. Every call has an optional
timeout, `timeout_s`: the client's default, or the one passed to the call. A frame entry that
outlasts it is not failed for that alone: the replica's liveness decides
(`cluster.routing.liveness`): heard from, or its engine stepped, it is busy and the wait goes
on; else it is dead or stalled, and the call raises `ReplicaUnavailableError` (fail over). A
unary call (Stats, Reference) that outlasts it raises that at once. Every call carries
the cluster's shared secret when the client has one (replicas refuse calls without it:
UNAUTHENTICATED, raised as `ClusterSecretError`).

Deadlines: `bounded(deadline)` gives one request's view of a client, sharing its channel. Its
calls wait no longer than the request has left, raise `DeadlineExceededError` without calling
once nothing is left (or when the time runs out during the call), and its `open_session`
sends the time left (`time_limit_ms`), so the replica drops the session itself even if the
router dies. Closing a session ignores the deadline: freeing it after the deadline is the point.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from types import TracebackType
from typing import Any, Self

import grpc

from cluster.routing.frame_channel import FrameChannel, settle
from cluster.routing.liveness import PROBE_TIMEOUT_S, Liveness, Progress
from cluster.routing.waits import Wait, Waits
from cluster.runtime.constraint import Constraint
from cluster.runtime.errors import DeadlineExceededError, ReplicaUnavailableError
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaStats
from cluster.wire import requests
from cluster.wire.metadata import MESSAGE_SIZE_OPTIONS, SECRET_METADATA_KEY
from cluster.wire.replica_stats import stats_from_wire
from cluster.wire.status import error_from_rpc
from protos import replica_pb2

NO_TIMEOUT = None
"""`timeout_s` value that waits for an answer as long as it takes."""


class ReplicaClient:
    """The channel, timeouts and error handling both clients share, and the common calls.

    `timeout_s` is every call's timeout in seconds (`NO_TIMEOUT`: none); a call's own
    `timeout_s` keyword, when given, replaces it for that call. A view made by `bounded` also
    holds its request's deadline.
    """

    _kind = "replica"
    _stub_class: Callable[[grpc.Channel], Any]
    """The service's stub class; each subclass names its service."""

    _service: str
    """The service's full name ("tandem.v1.Verifier"), for its Frames stream."""

    def __init__(
        self,
        target: grpc.Channel | str,
        timeout_s: float | None = NO_TIMEOUT,
        secret: str | None = None,
    ) -> None:
        """`target`: an open channel (still the caller's to close) or a "host:port" address
        (its channel is opened here and closed by `close`). `secret`: the cluster's shared
        secret, sent with every call."""
        if isinstance(target, str):
            self._channel = grpc.insecure_channel(target, options=list(MESSAGE_SIZE_OPTIONS))
            self._owns_channel = True
            self._replica = f"{self._kind} at {target}"
        else:
            self._channel = target
            self._owns_channel = False
            self._replica = self._kind
        self.timeout_s = timeout_s
        self._metadata = ((SECRET_METADATA_KEY, secret),) if secret is not None else None
        self._stub = self._stub_class(self._channel)
        self._frames = FrameChannel(self._channel, self._service, self._replica, self._metadata)
        """The Frames stream every view of this client shares."""
        self._liveness = Liveness(lambda: self._frames.heard_at, self._probe_progress)
        """Busy or dead, when a call outlasts `timeout_s` (shared by every view)."""
        self._owns_frames = True
        self._running: dict[str, int] = {}
        """Per running session (a verifier's), the tag its reports come under; shared by every
        view of this client."""
        self._deadline: float | None = None
        """The request's `time.monotonic()` deadline, on a view made by `bounded`."""

    def bounded(self, deadline: float | None) -> Self:
        """This client as seen by one request that must end by `deadline` (a
        `time.monotonic()` instant; None: no deadline, and this client itself is returned).

        A cheap view sharing the channel, stub and Frames stream: each call waits at most
        min(`timeout_s`, the time left) and raises `DeadlineExceededError` without calling
        when none is left; `open_session` sends the time left to the replica. `close_session`
        and `stats` ignore the deadline. Closing the view leaves the channel open.
        """
        if deadline is None:
            return self
        view = copy.copy(self)
        view._deadline = deadline
        view._owns_channel = False
        view._owns_frames = False
        return view

    def _time_left(self) -> float | None:
        """Seconds the request has left (None: no deadline); raises `DeadlineExceededError`
        when there are none."""
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(
                f"the request's deadline passed before its call to the {self._replica}"
            )
        return left

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout_s: float | None,
        bounded: bool = True,
    ) -> Any:
        """`method(request)` on the stub; a failed call raises the matching `TandemError`.

        `bounded`: the call stops at the request's deadline (a view's; see `bounded`).
        """
        own_timeout_s = self.timeout_s if timeout_s is None else timeout_s
        left = self._time_left() if bounded else None
        wait_s = min((t for t in (own_timeout_s, left) if t is not None), default=None)
        started = time.monotonic()
        try:
            return method(request, timeout=wait_s, metadata=self._metadata)
        except grpc.RpcError as error:
            now = time.monotonic()
            out_of_time = left is not None and self._deadline is not None and now >= self._deadline
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and out_of_time:
                # Whichever timer fired, the request has no time left: nothing to fail over.
                raise DeadlineExceededError(
                    f"the request's deadline passed while waiting for the {self._replica}"
                ) from error
            timed_out = own_timeout_s is not None and now - started >= own_timeout_s
            raise error_from_rpc(error, self._replica, timed_out) from error

    def _send(
        self, call: str, request: Any, timeout_s: float | None, bounded: bool = True
    ) -> Waits[Any]:
        """`request` as a frame entry whose `call` field is `call`; yields its waits, returning the
        answer's message. The same waits and errors as `_call`: at most min(timeout, the time
        left), then `DeadlineExceededError` once the request's time is up, else
        `ReplicaUnavailableError` (the replica was too slow)."""
        own_timeout_s = self.timeout_s if timeout_s is None else timeout_s
        left = self._time_left() if bounded else None
        future: Future[Any] = Future()
        tag = self._frames.send(replica_pb2.FrameEntry(**{call: request}), partial(settle, future))
        return (yield from self._answer(future, tag, own_timeout_s, left))

    def _answer(
        self, future: Future[Any], tag: int, own_timeout_s: float | None, left: float | None
    ) -> Waits[Any]:
        """Wait for entry `tag`'s `future` until the request's time is `left`; each time
        `own_timeout_s` passes without an answer, the replica's liveness decides: busy (heard
        from, or its engine stepped), the wait goes on; dead or stalled, it fails over."""
        deadline = None if left is None else self._deadline  # None: not bounded by it
        while True:
            started = time.monotonic()
            left = None if deadline is None else deadline - started
            wait_s = min((t for t in (own_timeout_s, left) if t is not None), default=None)
            if not future.done() and (wait_s is None or wait_s > 0):
                yield Wait(future, wait_s)
            if future.done():
                return future.result()
            if deadline is not None and time.monotonic() >= deadline:
                self._frames.forget(tag)
                raise DeadlineExceededError(
                    f"the request's deadline passed while waiting for the {self._replica}"
                )
            busy = self._liveness.check(started - (wait_s or 0.0))  # the last two windows
            if not busy.done():
                yield Wait(busy, PROBE_TIMEOUT_S + 1.0)
            if future.done():
                return future.result()
            if not (busy.done() and busy.result()):
                self._frames.forget(tag)
                raise ReplicaUnavailableError(
                    f"{self._replica}: DEADLINE_EXCEEDED: no answer within {wait_s:g} s, and "
                    "no progress (nothing heard, its engine took no step and runs none)"
                )

    def progressing(self, since: float) -> Future[bool]:
        """A future of whether the replica made progress since `since` (`time.monotonic()`):
        True busy, False dead or stalled (`cluster.routing.liveness`)."""
        return self._liveness.check(since)

    def _probe_progress(self) -> Future[Progress]:
        """A future of the replica's progress (engine steps plus frames sent, and how long its
        step running now has run), failed when it does not answer its `Stats` within
        `PROBE_TIMEOUT_S`."""
        counted: Future[Progress] = Future()
        call = self._stub.Stats.future(
            replica_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S, metadata=self._metadata
        )

        def done(answered: Any) -> None:
            try:
                stats = answered.result()
                count = int(stats.engine.steps) + int(stats.frames_sent)
                counted.set_result(Progress(count, stats.engine.step_running_s))
            except Exception as error:
                counted.set_exception(error)

        call.add_done_callback(done)
        return counted

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
        timeout_s: float | None = None,
        tenant: str = "",
    ) -> Waits[int]:
        """Open a session; yields its waits (`cluster.routing.waits`), returning its committed
        length.
        `tenant`: whose request it is (a suffix drafter drafts from that tenant's text only)."""
        request = requests.open_request_to_wire(
            session_id,
            prompt_tokens,
            sampling,
            seed,
            max_new_tokens=max_new_tokens,
            resumed=resumed,
            constraint=constraint,
            time_left_s=self._time_left(),
            tenant=tenant,
        )
        response: replica_pb2.OpenSessionResponse = yield from self._send(
            "open", request, timeout_s
        )
        return response.committed_length

    def close_session(self, session_id: str, *, timeout_s: float | None = None) -> Waits[bool]:
        """Free the session; yields its waits, returning True if it existed."""
        request = requests.close_request_to_wire(session_id)
        # Not bounded: a session is freed even after its request's deadline.
        response: replica_pb2.CloseSessionResponse = yield from self._send(
            "close", request, timeout_s, bounded=False
        )
        return response.existed

    def stats(self, *, timeout_s: float | None = None) -> ReplicaStats:
        """What the replica holds right now."""
        return stats_from_wire(
            self._call(self._stub.Stats, replica_pb2.StatsRequest(), timeout_s, bounded=False)
        )

    def close(self) -> None:
        """End this client's Frames stream (a view's close leaves it to the client) and close
        the channel if this client opened it; a channel passed in stays open."""
        if self._owns_frames:
            self._frames.close()
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
