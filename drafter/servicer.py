"""The drafter's gRPC servicer: `tandem.v1.Drafter` over a plain `Drafter`.

A thin adapter: each handler converts the request with `verifier.replica.wire`, calls the component
under the servicer's `CallGuard` (one call at a time; errors become gRPC statuses), and
converts the result back. `serve_drafter` starts a server with just this servicer.
"""

from __future__ import annotations

import grpc

from drafter.drafter import Drafter
from protos import replica_pb2, replica_pb2_grpc
from verifier.replica import wire
from verifier.replica.rpc import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_WORKERS,
    CallGuard,
    start_server,
)


class DrafterServicer(replica_pb2_grpc.DrafterServicer):
    """Serves one `Drafter` over gRPC."""

    def __init__(self, drafter: Drafter) -> None:
        self._drafter = drafter
        self._guard = CallGuard("Drafter")

    def OpenSession(
        self, request: replica_pb2.OpenSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.OpenSessionResponse:
        def call() -> replica_pb2.OpenSessionResponse:
            length = self._drafter.open_session(
                wire.session_id_from_wire(request.session_id),
                tuple(request.prompt_token_ids),
                wire.sampling_from_wire(request.sampling),
                request.seed,
                time_limit_s=wire.time_limit_from_wire(request),
            )
            return replica_pb2.OpenSessionResponse(committed_length=length)

        return self._guard.run(context, "OpenSession", call)

    def Draft(
        self, request: replica_pb2.DraftRequest, context: grpc.ServicerContext
    ) -> replica_pb2.DraftBlock:
        def call() -> replica_pb2.DraftBlock:
            block = self._drafter.draft(
                wire.session_id_from_wire(request.session_id),
                request.base_length,
                tuple(request.appended_token_ids),
                request.num_tokens,
                truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
            )
            return wire.block_to_wire(block)

        return self._guard.run(context, "Draft", call)

    def CloseSession(
        self, request: replica_pb2.CloseSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.CloseSessionResponse:
        def call() -> replica_pb2.CloseSessionResponse:
            existed = self._drafter.close_session(wire.session_id_from_wire(request.session_id))
            return replica_pb2.CloseSessionResponse(existed=existed)

        return self._guard.run(context, "CloseSession", call)

    def Stats(
        self, request: replica_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReplicaStats:
        return self._guard.run(context, "Stats", lambda: wire.stats_to_wire(self._drafter.stats()))


def serve_drafter(
    drafter: Drafter,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    secret: str | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `drafter`; returns it and its port (see `rpc.start_server`)."""
    servicer = DrafterServicer(drafter)
    return start_server(
        lambda server: replica_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
        host,
        port,
        max_workers,
        secret,
        max_concurrent_rpcs,
    )
