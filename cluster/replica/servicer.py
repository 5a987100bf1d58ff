"""What the drafter's and the verifier's gRPC servicers share: the session RPCs.

`SessionServicer` serves OpenSession, CloseSession and Stats over a `SessionComponent`: each
handler converts the request with `cluster.wire.convert`, calls the component under the
servicer's `CallGuard` (errors become gRPC statuses; calls run concurrently, batched by the
component's engine), and converts the result back. Each side's servicer (`drafter.servicer`,
`verifier.servicer`) adds its own RPC (Draft, Verify) the same way, and says how it registers on
a server (`add_to_server`).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import grpc

from cluster.replica.rpc import CallGuard
from cluster.runtime.component import SessionComponent
from cluster.wire import convert
from protos import replica_pb2

K = TypeVar("K", bound=SessionComponent[Any])


class SessionServicer(Generic[K]):
    """Serves the session RPCs of one component over gRPC; a side's servicer extends it."""

    def __init__(self, component: K, component_name: str) -> None:
        """`component_name` names the component in the log of an unexpected failure."""
        self.component = component
        self._guard = CallGuard(component_name)

    def add_to_server(self, server: grpc.Server) -> None:
        """Register this servicer on `server` (what `start_server` takes as `add_servicer`)."""
        raise NotImplementedError

    def OpenSession(
        self, request: replica_pb2.OpenSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.OpenSessionResponse:
        def call() -> replica_pb2.OpenSessionResponse:
            length = self.component.open_session(
                convert.session_id_from_wire(request.session_id),
                tuple(request.prompt_token_ids),
                convert.sampling_from_wire(request.sampling),
                request.seed,
                time_limit_s=convert.time_limit_from_wire(request),
                max_new_tokens=(
                    request.max_new_tokens if request.HasField("max_new_tokens") else None
                ),
                resumed=request.resumed,
                constraint=convert.constraint_from_wire(request),
            )
            return replica_pb2.OpenSessionResponse(committed_length=length)

        return self._guard.run(context, "OpenSession", call)

    def CloseSession(
        self, request: replica_pb2.CloseSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.CloseSessionResponse:
        def call() -> replica_pb2.CloseSessionResponse:
            existed = self.component.close_session(convert.session_id_from_wire(request.session_id))
            return replica_pb2.CloseSessionResponse(existed=existed)

        return self._guard.run(context, "CloseSession", call)

    def Stats(
        self, request: replica_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReplicaStats:
        return self._guard.run(
            context, "Stats", lambda: convert.stats_to_wire(self.component.stats())
        )
