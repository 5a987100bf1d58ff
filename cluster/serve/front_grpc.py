"""The router replica's own gRPC server: every stream on one event loop, no thread per call.

`GrpcFront` runs a `grpc.aio` server on an asyncio event loop of its own thread in the router
replica, with the public API's one servicer (`cluster.serve.tandem_servicer.TandemServicer`:
generation as waits on the loop, so 1,000 streams cost the same threads as one) and gRPC
health (`AsyncHealthServicer`). Here the client's gRPC deadline is the request's
(`caller_of`), and a failed call is aborted with its status (`abort_call`). The health check's
look at the replicas runs on the loop's default executor.

What an anonymous client can hold or make the router do is bounded:
- Every call but the health service's is authenticated before its payload is parsed
  (`KeyCheck`): a call with a missing or unknown key is answered UNAUTHENTICATED from its
  metadata alone, its bytes never parsed. Reflection is one of those calls.
- A request message may be at most `FrontConfig.max_request_bytes` (4 MiB; gRPC refuses a
  larger one with RESOURCE_EXHAUSTED while reading it), far below the replicas' internal limit.
- Health `Watch` streams, open to every caller, are at most `FrontConfig.max_health_watches`
  at once (64), and `max_health_watches_per_caller` (8) from one peer address; one more is
  answered RESOURCE_EXHAUSTED, so that they never take the slots that `Generate` needs.

Payloads that are not the method's message are answered INVALID_ARGUMENT (`ParseCheck`), as on
the replicas' servers. The server binds with SO_REUSEPORT (see `cluster.serve.front`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.api.caller import Caller
from cluster.api.service import TandemService
from cluster.api.tenants import bearer_key
from cluster.config import FrontConfig
from cluster.runtime.errors import ResourceExhaustedError
from cluster.serve.tandem_servicer import Fail, TandemServicer, abort_call
from cluster.wire.metadata import MAX_MESSAGE_BYTES
from protos import generate_pb2_grpc

START_TIMEOUT_S = 30.0
HEALTH_WATCH_PERIOD_S = 1.0
BLOCKING_THREADS = 16
"""Threads for the calls that block: audits, the health check's look at the replicas."""
HEALTH_SERVICE = "/grpc.health.v1.Health/"


class AsyncHealthServicer(health_pb2_grpc.HealthServicer):
    """gRPC health: SERVING while `healthy()` (run off the loop: it may read the registry).
    At most `limits.max_health_watches` `Watch` streams at once, and
    `limits.max_health_watches_per_caller` from one peer address (RESOURCE_EXHAUSTED past
    either, through `fail`, as `TandemServicer`'s). Every door serves it: the router's own
    server and, through Serve's proxy, the ingress."""

    def __init__(
        self, healthy: Callable[[], bool], limits: FrontConfig, fail: Fail = abort_call
    ) -> None:
        self._healthy = healthy
        self._fail = fail
        self._max_watches = limits.max_health_watches
        self._max_per_caller = limits.max_health_watches_per_caller
        self._watches: Counter[str] = Counter()
        """Open watches by peer address (counted on the loop's one thread)."""

    async def _status(self) -> int:
        healthy = await asyncio.get_running_loop().run_in_executor(None, self._healthy)
        return (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Any = None
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=await self._status())

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any = None
    ) -> AsyncGenerator[health_pb2.HealthCheckResponse, None]:
        caller = peer_address(context.peer()) if context is not None else ""
        if self._watches.total() >= self._max_watches:
            await self._fail(
                context,
                ResourceExhaustedError(
                    f"at most {self._max_watches} health watches at once: poll with Check"
                ),
            )
        if self._watches[caller] >= self._max_per_caller:
            await self._fail(
                context,
                ResourceExhaustedError(
                    f"at most {self._max_per_caller} health watches from one caller: poll "
                    "with Check"
                ),
            )
        self._watches[caller] += 1
        try:
            last = None
            while True:
                status = await self._status()
                if status != last:
                    last = status
                    yield health_pb2.HealthCheckResponse(status=status)
                await asyncio.sleep(HEALTH_WATCH_PERIOD_S)
        finally:
            self._watches[caller] -= 1
            if not self._watches[caller]:
                del self._watches[caller]


def peer_address(peer: str) -> str:
    """The caller's address without its port, from gRPC's peer string ("ipv4:10.0.0.7:51234",
    "ipv6:[::1]:51234"; "unix:..." and others whole)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return rest.rsplit(":", 1)[0]
    return peer


class KeyCheck(grpc.aio.ServerInterceptor):
    """Authenticates every call but the health service's from its metadata, before gRPC hands
    its payload to a parser: a missing or unknown key is answered UNAUTHENTICATED, the payload
    never parsed (`authenticate`: `TandemService.authenticate`'s test of the key)."""

    def __init__(self, authenticate: Callable[[Caller], object]) -> None:
        self._authenticate = authenticate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_SERVICE):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        try:
            self._authenticate(Caller(bearer_key(metadata)))
        except Exception as error:
            return _refusal(handler, error)
        return handler


def _refusal(handler: Any, error: Exception) -> Any:
    """A handler of `handler`'s kind that answers `error`'s status, its payload left as bytes."""

    async def refuse(_: object, context: grpc.aio.ServicerContext) -> NoReturn:
        await abort_call(context, error)

    async def refuse_stream(_: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort_call(context, error)
        yield  # never reached: a generator, as a streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


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
        limits: FrontConfig | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        """Serve on `host:port` (0: a free port, then `self.port`); at most `max_streams`
        calls at once (one more is answered RESOURCE_EXHAUSTED), with `limits`' message size
        and health watches (default: `FrontConfig`'s; its ports and host are not read), and
        `interceptors` after the front's own. Raises RuntimeError, naming the address, when it
        cannot bind."""
        limits = FrontConfig() if limits is None else limits
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"grpc-front-{port}", daemon=True
        )
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._threads = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="grpc-front")
        start = self._start(service, healthy, host, port, max_streams, limits, interceptors)
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
        limits: FrontConfig,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
    ) -> int:
        server = grpc.aio.server(
            interceptors=[KeyCheck(service.authenticate), ParseCheck(), *interceptors],
            options=[
                ("grpc.max_receive_message_length", limits.max_request_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 1),
            ],
            maximum_concurrent_rpcs=max_streams,
        )
        servicer = TandemServicer(service, self._threads)
        generate_pb2_grpc.add_TandemServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(AsyncHealthServicer(healthy, limits), server)
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

    def stop(self, grace_s: float | None) -> None:
        """Refuse new calls, give calls in flight `grace_s` (None: none), then cancel them; end
        the loop."""
        if self._server is not None:
            stopping = asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop)
            stopping.result((grace_s or 0.0) + START_TIMEOUT_S)
            self._server = None
        self._end_loop()

    def _end_loop(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
