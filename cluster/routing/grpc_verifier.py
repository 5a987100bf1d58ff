"""A verifier replica over gRPC: `GrpcVerifier`, the router's `VerifierPort` over the network.

Its session calls (open, verify, close) are entries of the client's Frames stream, with the
timeouts, liveness, errors and deadlines of every replica client
(`cluster.routing.grpc_replica`). A session opened with an `Advance` runs: the client hands
every later result under its open entry's tag (the session's own steps, or the error that
stopped it) to the request's `SessionEvents`, and the verdicts of the blocks `post` sends
there too, until the session is closed. A drafter's q rows in a posted block are sent on as
received. `reference` (the audit's replay through the plain target) is a unary call.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from cluster.routing.frame_channel import settle
from cluster.routing.grpc_replica import ReplicaClient
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits
from cluster.runtime.advance import Advance
from cluster.runtime.audit import Replay
from cluster.runtime.constraint import Constraint
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import DeadlineExceededError, ReplicaUnavailableError, TandemError
from cluster.runtime.sampling import SamplingParams
from cluster.wire import requests
from cluster.wire.blocks import verdict_from_wire
from cluster.wire.distributions import floats_from_wire
from cluster.wire.fields import token_ids_to_wire, uint_to_wire
from cluster.wire.sampling_settings import sampling_to_wire
from protos import replica_pb2, replica_pb2_grpc


class GrpcVerifier(ReplicaClient):
    """A verifier replica over gRPC; a `VerifierPort`."""

    _kind = "verifier"
    _service = "tandem.v1.Verifier"
    _stub_class = replica_pb2_grpc.VerifierStub

    def open_session(  # type: ignore[override]
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
        advance: Advance | None = None,
        events: SessionEvents | None = None,
        timeout_s: float | None = None,
    ) -> Waits[int]:
        """See `VerifierPort.open_session`: with `advance`, every later result under the
        open entry's tag (the session's own steps, or the error that stopped it) goes to
        `events`, until the session is closed."""
        if advance is None:
            return (
                yield from super().open_session(
                    session_id,
                    prompt_tokens,
                    sampling,
                    seed,
                    max_new_tokens=max_new_tokens,
                    resumed=resumed,
                    constraint=constraint,
                    timeout_s=timeout_s,
                )
            )
        assert events is not None, "a running session reports to its events"
        request = requests.open_request_to_wire(
            session_id,
            prompt_tokens,
            sampling,
            seed,
            max_new_tokens=max_new_tokens,
            resumed=resumed,
            constraint=constraint,
            time_left_s=self._time_left(),
            advance=advance,
        )
        own_timeout_s = self.timeout_s if timeout_s is None else timeout_s
        left = self._time_left()
        opened: Future[Any] = Future()
        tag = self._frames.send(
            replica_pb2.FrameEntry(open=request), _Running(opened, events), stays=True
        )
        self._running[session_id] = tag
        response: replica_pb2.OpenSessionResponse = yield from self._answer(
            opened, tag, own_timeout_s, left
        )
        return response.committed_length

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        """See `VerifierPort.post`. A drafter's q rows are sent on as received; on a view with
        no time left, nothing is sent and `DeadlineExceededError` is the post's answer."""
        try:
            self._time_left()
        except DeadlineExceededError as error:
            events.push(post_id, error)
            return
        request = requests.verify_request_to_wire(session_id, block, defer_bonus)
        self._frames.send(replica_pb2.FrameEntry(verify=request), partial(_posted, events, post_id))

    def close_session(self, session_id: str, *, timeout_s: float | None = None) -> Waits[bool]:
        """Free the session; yields its waits, returning True if it existed. A running session's
        reports stop being read first."""
        tag = self._running.pop(session_id, None)
        if tag is not None:
            self._frames.release(tag)
        return (yield from super().close_session(session_id, timeout_s=timeout_s))

    def reference(
        self,
        prompt_tokens: Sequence[int],
        served_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        dtype: str = "",
        *,
        timeout_s: float | None = None,
    ) -> Replay:
        """See `VerifierPort.reference`. A replay waits while the replica serves calls, so
        under load it may take long: its timeout and deadline are those of any call."""
        request = replica_pb2.ReferenceRequest(
            prompt_token_ids=token_ids_to_wire(prompt_tokens, "prompt_tokens"),
            served_token_ids=token_ids_to_wire(served_tokens, "served_tokens"),
            sampling=sampling_to_wire(sampling),
            seed=uint_to_wire(seed, "seed"),
            dtype=dtype,
        )
        response: replica_pb2.ReferenceResponse = self._call(
            self._stub.Reference, request, timeout_s
        )
        tokens = tuple(response.token_ids)
        gaps = floats_from_wire(response.gaps, "gaps")
        served_gaps = floats_from_wire(response.served_gaps, "served_gaps")
        if len(gaps) != len(tokens) or len(served_gaps) not in (0, len(tokens)):
            raise ReplicaUnavailableError(
                f"{self._replica}: a reference of {len(tokens)} tokens came with {len(gaps)} "
                f"gaps and {len(served_gaps)} served gaps"
            )
        return Replay(tokens, gaps, response.dtype, served_gaps)


class _Running:
    """Where a running session's open entry delivers: its answer to `opened`, then each of the
    session's own steps (or the error that stopped it) to `events`."""

    __slots__ = ("_events", "_opened")

    def __init__(self, opened: Future[Any], events: SessionEvents) -> None:
        self._opened = opened
        self._events = events

    def __call__(self, answer: Any) -> None:
        if not self._opened.done():
            settle(self._opened, answer)  # an open that failed reports nothing further
            return
        if isinstance(answer, TandemError):
            self._events.report(answer)
        else:
            self._events.report(verdict_from_wire(answer))


def _posted(events: SessionEvents, post_id: int, answer: Any) -> None:
    """A posted block's verdict, or the error it failed with, into the request's events."""
    if isinstance(answer, TandemError):
        events.push(post_id, answer)
    else:
        events.push(post_id, verdict_from_wire(answer))
