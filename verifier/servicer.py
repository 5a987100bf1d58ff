"""The verifier's gRPC servicer: `tandem.v1.Verifier` over a plain `Verifier`.

A thin adapter: each handler converts the request with `verifier.replica.wire`, calls the component
under the servicer's `CallGuard` (one call at a time; errors become gRPC statuses), and
converts the result back. `serve_verifier` starts a server with just this servicer.
"""

from __future__ import annotations

import grpc

from protos import replica_pb2, replica_pb2_grpc
from verifier.replica import wire
from verifier.replica.rpc import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_WORKERS,
    CallGuard,
    start_server,
)
from verifier.verifier import Verifier


class VerifierServicer(replica_pb2_grpc.VerifierServicer):
    """Serves one `Verifier` over gRPC."""

    def __init__(self, verifier: Verifier) -> None:
        self._verifier = verifier
        self._guard = CallGuard("Verifier")

    def OpenSession(
        self, request: replica_pb2.OpenSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.OpenSessionResponse:
        def call() -> replica_pb2.OpenSessionResponse:
            length = self._verifier.open_session(
                wire.session_id_from_wire(request.session_id),
                tuple(request.prompt_token_ids),
                wire.sampling_from_wire(request.sampling),
                request.seed,
                time_limit_s=wire.time_limit_from_wire(request),
            )
            return replica_pb2.OpenSessionResponse(committed_length=length)

        return self._guard.run(context, "OpenSession", call)

    def Verify(
        self, request: replica_pb2.VerifyRequest, context: grpc.ServicerContext
    ) -> replica_pb2.Verdict:
        def call() -> replica_pb2.Verdict:
            verdict = self._verifier.verify(
                wire.session_id_from_wire(request.session_id),
                wire.block_from_wire(request.block),
                defer_bonus=request.defer_bonus,
            )
            return wire.verdict_to_wire(verdict)

        return self._guard.run(context, "Verify", call)

    def CloseSession(
        self, request: replica_pb2.CloseSessionRequest, context: grpc.ServicerContext
    ) -> replica_pb2.CloseSessionResponse:
        def call() -> replica_pb2.CloseSessionResponse:
            existed = self._verifier.close_session(wire.session_id_from_wire(request.session_id))
            return replica_pb2.CloseSessionResponse(existed=existed)

        return self._guard.run(context, "CloseSession", call)

    def Stats(
        self, request: replica_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReplicaStats:
        return self._guard.run(context, "Stats", lambda: wire.stats_to_wire(self._verifier.stats()))


def serve_verifier(
    verifier: Verifier,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    secret: str | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `verifier`; returns it and its port (see `rpc.start_server`)."""
    servicer = VerifierServicer(verifier)
    return start_server(
        lambda server: replica_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
        host,
        port,
        max_workers,
        secret,
        max_concurrent_rpcs,
    )
