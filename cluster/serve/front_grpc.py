"""The router replica's own gRPC server: every stream on one event loop, no thread per call.

`GrpcFront` runs a `grpc.aio` server on an asyncio event loop of its own thread in the router
replica. `tandem.v1.Tandem`'s generation calls run as steps (`cluster.routing.waits`): the
request's router loop runs on the loop's thread between its waits, and each wait for a replica
(a frame entry's answer, a place in the router's queue) is awaited there. So 1,000 streams cost
the same threads as one, and a frame that answers many sessions wakes one thread, not one per
session. What a slow reader has pending is merged into one chunk (`cluster.serve.calls.
stream_merged`, as on Serve's proxies). A client that goes away cancels its call's task, which
closes its steps: its sessions are freed. The client's gRPC deadline is the request's.

The calls that do not generate: Cancel and GetUsage are quick and run on the loop; Audit (a
replay through the plain target, which may wait long) and the health check's look at the
replicas run on the loop's default executor.

Payloads that are not the method's message are answered INVALID_ARGUMENT (`ParseCheck`), as on
the replicas' servers. The server binds with SO_REUSEPORT (see `cluster.serve.front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.api.convert import chunk_to_proto, response_to_proto
from cluster.api.grpc_api import GrpcApi
from cluster.api.grpc_servicer import caller_of
from cluster.api.response import ApiChunk, coalesce, merge
from cluster.api.service import TandemService
from cluster.api.status import status_of, trailers_of
from cluster.routing.waits import Wait
from cluster.serve.calls import stream_merged
from cluster.wire.metadata import MESSAGE_SIZE_OPTIONS
from protos import generate_pb2, generate_pb2_grpc

START_TIMEOUT_S = 30.0
HEALTH_WATCH_PERIOD_S = 1.0
BLOCKING_THREADS = 16
"""Threads for the calls that block: audits, the health check's look at the replicas."""


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    code, message = status_of(error)
    trailers = trailers_of(error)
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(code, message)
    raise AssertionError("grpc.aio.ServicerContext.abort returned")


class AsyncTandemServicer(generate_pb2_grpc.TandemServicer):
    """`tandem.v1.Tandem` over one `TandemService`, on the event loop (see the module doc)."""

    def __init__(self, service: TandemService, threads: ThreadPoolExecutor) -> None:
        """`threads`: where a request runs if its router's replicas do not answer on frames
        (`TandemService.waits_without_threads` is False), and the audit's replays."""
        self._api = GrpcApi(service)
        self._service = service
        self._threads = threads

    def _chunks(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[ApiChunk, None]:
        caller = caller_of(context)

        def steps() -> Iterator[ApiChunk | Wait]:
            # Made in the first step, so that validating and tokenizing run off the loop.
            yield from self._api.chunk_steps(request, caller)

        return stream_merged(steps(), self._threads, coalesce)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        try:
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                return response_to_proto(merge([chunk async for chunk in chunks]))
        except Exception as error:
            await _abort(context, error)

    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        try:
            # Closed however the call ends (`async for` left by an exception does not close).
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk_to_proto(chunk)
        except Exception as error:
            await _abort(context, error)

    async def Cancel(
        self, request: generate_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.CancelResponse:
        try:
            self._api.cancel(request, caller_of(context))
            return generate_pb2.CancelResponse()
        except Exception as error:
            await _abort(context, error)

    async def GetUsage(
        self, request: generate_pb2.UsageRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TenantUsage:
        try:
            return self._api.usage(caller_of(context))
        except Exception as error:
            await _abort(context, error)

    async def Audit(
        self, request: generate_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AuditResponse:
        try:
            caller = caller_of(context)
            audit = partial(self._api.audit, request, caller, lambda: not context.cancelled())
            return await asyncio.get_running_loop().run_in_executor(self._threads, audit)
        except Exception as error:
            await _abort(context, error)


class AsyncHealthServicer(health_pb2_grpc.HealthServicer):
    """gRPC health: SERVING while `healthy()` (run off the loop: it may read the registry)."""

    def __init__(self, healthy: Callable[[], bool]) -> None:
        self._healthy = healthy

    async def _status(self) -> int:
        healthy = await asyncio.get_running_loop().run_in_executor(None, self._healthy)
        return (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=await self._status())

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = await self._status()
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(HEALTH_WATCH_PERIOD_S)


class ParseCheck(grpc.aio.ServerInterceptor):
    """Parses each unary request in the handler instead of in gRPC: a payload that is not the
    method's message is answered INVALID_ARGUMENT (gRPC would answer INTERNAL)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: the payload is not a valid request message",
                )

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for item in behavior(await parsed(raw, context), context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=handler.response_serializer
            )
        unary_behavior = handler.unary_unary

        async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary_behavior(await parsed(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=handler.response_serializer
        )


class GrpcFront:
    """The server on its own loop and thread; `stop` ends both."""

    def __init__(
        self,
        service: TandemService,
        healthy: Callable[[], bool],
        host: str,
        port: int,
        max_streams: int,
    ) -> None:
        """Serve on `host:port` (0: a free port, then `self.port`); at most `max_streams`
        calls at once (one more is answered RESOURCE_EXHAUSTED). Raises RuntimeError, naming
        the address, when it cannot bind."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"grpc-front-{port}", daemon=True
        )
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._threads = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="grpc-front")
        start = self._start(service, healthy, host, port, max_streams)
        try:
            self.port: int = asyncio.run_coroutine_threadsafe(start, self._loop).result(
                START_TIMEOUT_S
            )
        except BaseException:
            self._end_loop()
            raise

    async def _start(
        self,
        service: TandemService,
        healthy: Callable[[], bool],
        host: str,
        port: int,
        max_streams: int,
    ) -> int:
        server = grpc.aio.server(
            interceptors=[ParseCheck()],
            options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 1)],
            maximum_concurrent_rpcs=max_streams,
        )
        servicer = AsyncTandemServicer(service, self._threads)
        generate_pb2_grpc.add_TandemServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(AsyncHealthServicer(healthy), server)
        names = ("tandem.v1.Tandem", "grpc.health.v1.Health", reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound_port = server.add_insecure_port(address)
        except RuntimeError as error:
            await server.stop(None)
            raise RuntimeError(f"cannot bind a gRPC server to {address}: {error}") from error
        await server.start()
        self._server = server
        return bound_port

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, give calls in flight `grace_s`, then cancel them; end the loop."""
        if self._server is not None:
            stopping = asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop)
            stopping.result(grace_s + START_TIMEOUT_S)
            self._server = None
        self._end_loop()

    def _end_loop(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
