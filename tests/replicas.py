"""A drafter or verifier replica's gRPC server on its own (no Serve, no registry), for tests.

`serve_replica` starts a server with one side's servicer (see `cluster.replica.rpc.start_server`
for the options); `serve_drafter` and `serve_verifier` build that servicer over a component.
"""

from __future__ import annotations

from typing import Any

import grpc

from cluster.replica.rpc import DEFAULT_MAX_CONCURRENT_RPCS, DEFAULT_MAX_WORKERS, start_server
from cluster.replica.servicer import SessionServicer
from drafter.drafter import Drafter
from drafter.servicer import DrafterServicer
from verifier.servicer import VerifierServicer
from verifier.verifier import Verifier


def serve_replica(
    servicer: SessionServicer[Any],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    secret: str | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `servicer`; returns it and its port."""
    return start_server(
        servicer.add_to_server, host, port, max_workers, secret, max_concurrent_rpcs
    )


def serve_drafter(drafter: Drafter, **options: Any) -> tuple[grpc.Server, int]:
    """`serve_replica` for a drafter."""
    return serve_replica(DrafterServicer(drafter), **options)


def serve_verifier(verifier: Verifier, **options: Any) -> tuple[grpc.Server, int]:
    """`serve_replica` for a verifier."""
    return serve_replica(VerifierServicer(verifier), **options)
