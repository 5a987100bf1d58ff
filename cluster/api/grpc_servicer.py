"""The public `tandem.v1.Tandem` API as a plain gRPC servicer: the router replica's own server
(`cluster.serve.front`) and the tests' front.

`TandemServicer` is a thin adapter over `TandemService`, through the gRPC face's own adapter
(`cluster.api.grpc_api.GrpcApi`, which converts messages to domain types and back): it hands
each request to it with its caller (the `authorization` metadata and the client's deadline,
which the router then propagates to replicas as remaining time), and turns any exception into
a gRPC status with `cluster.api.status` (a `TandemError` keeps its code and message, plus
`retry-after-ms` trailing metadata when it has a retry time; anything else is INTERNAL
"internal error", traceback logged, never sent).
A unary call stops early when its client has gone (cancelled or past its deadline); a stream
stops at its next chunk, and closing it frees the request's sessions on both replicas.

The server runs each call on a thread of its pool: a stream runs its router loop on that thread
and writes each chunk as it is committed, with no hop to another thread or process. The
service's router must be safe to call from several threads at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NoReturn

import grpc

from cluster.api.caller import Caller
from cluster.api.grpc_api import GrpcApi
from cluster.api.service import TandemService
from cluster.api.status import status_of, trailers_of
from cluster.api.tenants import bearer_key
from protos import generate_pb2, generate_pb2_grpc

NO_DEADLINE_S = 1e8
"""A `time_remaining()` beyond this (about three years) means the client set no deadline."""


def caller_of(context: grpc.ServicerContext) -> Caller:
    """Who sent the call (its `authorization` metadata) and its deadline, if any."""
    remaining = context.time_remaining()
    deadline = (
        time.monotonic() + remaining
        if remaining is not None and remaining < NO_DEADLINE_S
        else None
    )
    return Caller(bearer_key(context.invocation_metadata() or ()), deadline)


def _abort(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    code, message = status_of(error)
    trailers = trailers_of(error)
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(code, message)
    # context.abort always raises; this line only tells the type checker so.
    raise AssertionError("grpc.ServicerContext.abort returned")


class TandemServicer(generate_pb2_grpc.TandemServicer):
    """Serves one `TandemService` over gRPC."""

    def __init__(self, service: TandemService) -> None:
        self._service = GrpcApi(service)

    def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        try:
            return self._service.generate(request, context.is_active, caller_of(context))
        except Exception as error:
            _abort(context, error)

    def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generate_pb2.GenerateChunk]:
        try:
            # When the client goes away, gRPC stops asking for chunks and drops this generator;
            # closing it closes `chunks` too, which frees the request's sessions.
            yield from self._service.stream(request, caller_of(context))
        except Exception as error:
            _abort(context, error)

    def Cancel(
        self, request: generate_pb2.CancelRequest, context: grpc.ServicerContext
    ) -> generate_pb2.CancelResponse:
        try:
            self._service.cancel(request, caller_of(context))
            return generate_pb2.CancelResponse()
        except Exception as error:
            _abort(context, error)

    def GetUsage(
        self, request: generate_pb2.UsageRequest, context: grpc.ServicerContext
    ) -> generate_pb2.TenantUsage:
        try:
            return self._service.usage(caller_of(context))
        except Exception as error:
            _abort(context, error)

    def Audit(
        self, request: generate_pb2.AuditRequest, context: grpc.ServicerContext
    ) -> generate_pb2.AuditResponse:
        try:
            return self._service.audit(request, caller_of(context), context.is_active)
        except Exception as error:
            _abort(context, error)
