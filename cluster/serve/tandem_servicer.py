"""The one servicer of the public `tandem.v1.Tandem` API, behind every door: the router replicas'
own gRPC server (`cluster.serve.front_grpc`), Serve's gRPC proxy (the ingress,
`cluster.serve.ingress`) and the tests' server.

`TandemServicer` serves one `TandemService` on an event loop, through the gRPC face's adapter
(`cluster.api.grpc_api.GrpcApi`: messages to domain types and back). A door injects only what
differs between doors, how it reads a call's caller and how it fails a call:

- `caller(context)`: the `Caller` (its key, and its deadline: the gRPC deadline on a plain gRPC
  server, `caller_of`; the `x-tandem-deadline-ms` metadata through Serve's proxy, which does
  not pass the gRPC deadline on).
- `fail(context, error)`: end the call with `error`'s status (`cluster.api.status.status_of`:
  a `TandemError` keeps its code and message, with `retry-after-ms` trailers when it has a retry
  time; anything else is INTERNAL "internal error", its traceback logged). On a gRPC server
  `abort_call` (the context aborts); through Serve's proxy the status is set on its context
  and the error raised (`cluster.serve.ingress`).

Generate and GenerateStream run as waits (`cluster.routing.waits`) on the loop
(`cluster.serve.calls.stream_merged`): the request's router loop runs on the loop's thread
between its waits, so no thread is held per call, and what a slow reader has pending is merged
into one chunk. A client that goes away cancels its call's task, which closes the stream: the
request's sessions are freed. Cancel and GetUsage are quick and run on the loop; Audit (a
replay through the plain target, which may wait long) runs on `threads`, told to stop when the
call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc

from cluster.api.caller import Caller
from cluster.api.convert import chunk_to_proto, response_to_proto
from cluster.api.grpc_api import GrpcApi
from cluster.api.response import ApiChunk, coalesce, merge
from cluster.api.service import TandemService
from cluster.api.status import status_of, trailers_of
from cluster.api.tenants import bearer_key
from cluster.routing.waits import Wait
from cluster.serve.calls import stream_merged
from cluster.wire.status import put_status
from protos import generate_pb2, generate_pb2_grpc

NO_DEADLINE_S = 1e8
"""A `time_remaining()` beyond this (about three years) means the client set no deadline."""

CallerOf = Callable[[Any], Caller]
Fail = Callable[[Any, Exception], Awaitable[NoReturn]]


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    """On a plain gRPC server: who sent the call (its `authorization` metadata) and its gRPC
    deadline, if any."""
    remaining = context.time_remaining()
    deadline = (
        time.monotonic() + remaining
        if remaining is not None and remaining < NO_DEADLINE_S
        else None
    )
    return Caller(bearer_key(context.invocation_metadata() or ()), deadline)


async def abort_call(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    """On a plain gRPC server: end the call with `error`'s public status and trailers."""
    await context.abort(*put_status(context, *status_of(error), trailers_of(error)))
    raise AssertionError("grpc.aio.ServicerContext.abort returned")


class TandemServicer(generate_pb2_grpc.TandemServicer):
    """`tandem.v1.Tandem` over one `TandemService`, on the event loop (see the module doc)."""

    def __init__(
        self,
        service: TandemService,
        threads: ThreadPoolExecutor,
        caller: CallerOf = caller_of,
        fail: Fail = abort_call,
    ) -> None:
        """`threads`: where a request runs if its router's replicas do not answer on frames
        (`TandemService.waits_without_threads` is False), and the audit's replays."""
        self._api = GrpcApi(service)
        self._threads = threads
        self._caller = caller
        self._fail = fail

    def _chunks(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncGenerator[ApiChunk, None]:
        caller = self._caller(context)

        def waits() -> Iterator[ApiChunk | Wait]:
            # Made when first resumed, so that validating and tokenizing run off the loop.
            yield from self._api.chunk_waits(request, caller)

        return stream_merged(waits(), self._threads, coalesce)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any = None
    ) -> generate_pb2.GenerateResponse:
        try:
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                return response_to_proto(merge([chunk async for chunk in chunks]))
        except Exception as error:
            await self._fail(context, error)

    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: Any = None
    ) -> AsyncGenerator[generate_pb2.GenerateChunk, None]:
        try:
            # Closed however the call ends (`async for` left by an exception does not close).
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk_to_proto(chunk)
        except Exception as error:
            await self._fail(context, error)

    async def Cancel(
        self, request: generate_pb2.CancelRequest, context: Any = None
    ) -> generate_pb2.CancelResponse:
        try:
            self._api.cancel(request, self._caller(context))
            return generate_pb2.CancelResponse()
        except Exception as error:
            await self._fail(context, error)

    async def GetUsage(
        self, request: generate_pb2.UsageRequest, context: Any = None
    ) -> generate_pb2.TenantUsage:
        try:
            return self._api.usage(self._caller(context))
        except Exception as error:
            await self._fail(context, error)

    async def Audit(
        self, request: generate_pb2.AuditRequest, context: Any = None
    ) -> generate_pb2.AuditResponse:
        active = threading.Event()
        active.set()
        try:
            caller = self._caller(context)
            audit = self._threads.submit(self._api.audit, request, caller, active.is_set)
            return await asyncio.wrap_future(audit)
        except asyncio.CancelledError:
            active.clear()  # the client has gone: the replay stops at its next check
            raise
        except Exception as error:
            await self._fail(context, error)
