"""The public `tandem.v1.Tandem` API on a plain gRPC server, without Ray: `serve_local` starts a
server with just `cluster.api.grpc_servicer.TandemServicer`, for tests and for running Tandem in
one process."""

from __future__ import annotations

import grpc

from cluster.api.grpc_servicer import TandemServicer, caller_of
from cluster.api.service import TandemService
from cluster.replica.rpc import DEFAULT_MAX_WORKERS, start_server
from protos import generate_pb2_grpc

__all__ = ["TandemServicer", "caller_of", "serve_local"]


def serve_local(
    service: TandemService,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> tuple[grpc.Server, int]:
    """Start an insecure gRPC server for `service`; port 0 picks a free one.

    Returns the running server and the port it bound; stop it with `server.stop(grace_s)`.
    """

    def add(server: grpc.Server) -> None:
        generate_pb2_grpc.add_TandemServicer_to_server(TandemServicer(service), server)

    return start_server(add, host, port, max_workers)
