"""The public `tandem.v1.Tandem` API on a plain gRPC server, without Ray: `serve_local` starts
the router's own gRPC server (`cluster.serve.front_grpc.GrpcFront`, with the API's one servicer)
over a service in this process, for tests."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from cluster.api.service import TandemService
from cluster.replica.rpc import DEFAULT_MAX_CONCURRENT_RPCS
from cluster.serve.front_grpc import GrpcFront


def serve_local(
    service: TandemService,
    host: str = "127.0.0.1",
    port: int = 0,
    max_streams: int = DEFAULT_MAX_CONCURRENT_RPCS,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[GrpcFront, int]:
    """Start a server for `service` (healthy throughout); port 0 picks a free one.

    Returns the running server and the port it bound; stop it with `server.stop(grace_s)`.
    """
    front = GrpcFront(service, lambda: True, host, port, max_streams, interceptors=interceptors)
    return front, front.port
