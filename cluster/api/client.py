"""Python clients of the public `tandem.v1.Tandem` API: `TandemClient` (blocking) and
`AsyncTandemClient` (asyncio, `grpc.aio`).

Both take a prompt as text or as token ids, or chat messages (`messages=[{"role": "user",
"content": "..."}]`, rendered by the server's chat template), plus the sampling and
speculation settings, and return plain frozen dataclasses: a `GenerateResult` for a whole
generation, `StreamChunk`s for a stream (the last chunk has the finish reason and a
`RequestStats`). The server validates every
setting; the client only refuses values the wire cannot carry (a negative seed, an int past
int32), with INVALID_ARGUMENT like the server. Every failure, local or from the server, is a
`TandemClientError` carrying the gRPC status code and the server's message.

Deadlines: `timeout_s` on the client is the default for every call; a call's own `timeout_s`
overrides it. A Generate or GenerateStream call with a timeout also sends it as
`x-tandem-deadline-ms` metadata (milliseconds left), which Ray Serve's gRPC proxy passes on
where it drops the gRPC deadline: the server then ends the request and frees its sessions on
time (see `cluster.serve.ingress`). Leaving a stream early (break, or an exception in the
loop) cancels the call, and the server frees the request's sessions; for the async stream,
close the iterator (e.g. with `contextlib.aclosing`) to cancel at once.

Auth: `api_key` is sent as `authorization: Bearer <key>` metadata with every call; a
RESOURCE_EXHAUSTED error carries the server's `retry_after_s` when it said when to retry (the
`retry-after-ms` trailer of a plain gRPC server; through Ray Serve's proxy, which drops trailers
from failed calls, the "retry in N s" its message ends with).

Metadata: `metadata` pairs go with every call. Ray Serve's gRPC proxy
routes by the `application` metadata entry when several Serve applications run; pass
`application="<app name>"` then, and it is sent as `("application", name)`.

This module needs only grpcio and the generated protos, not torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from types import TracebackType
from typing import Any, Generic, TypeVar, Unpack

import grpc
import grpc.aio

from cluster.api.client_types import (
    ChatMessages,
    GenerateResult,
    RequestSettings,
    StreamChunk,
    TandemClientError,
    build_request,
    chunk_from_proto,
    result_from_response,
    usage_from_proto,
)
from protos import generate_pb2, generate_pb2_grpc

__all__ = [
    "AsyncTandemClient",
    "GenerateResult",
    "StreamChunk",
    "TandemClient",
    "TandemClientError",
    "build_request",
]

APPLICATION_METADATA_KEY = "application"
"""The metadata key Ray Serve's gRPC proxy routes by."""


RETRY_AFTER_METADATA_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer: when to retry (cluster.api.status)."""
DEADLINE_METADATA_KEY = "x-tandem-deadline-ms"
"""Metadata a call's deadline goes in, as milliseconds left (cluster.serve.ingress)."""


def _timed(
    metadata: tuple[tuple[str, str], ...], timeout_s: float | None
) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the call's deadline, if it has one; whole milliseconds, rounded down
    so that the server never outlasts the client."""
    if timeout_s is None:
        return metadata
    return (*metadata, (DEADLINE_METADATA_KEY, str(math.floor(timeout_s * 1000))))


def _call_metadata(
    metadata: Sequence[tuple[str, str]], application: str | None, api_key: str | None
) -> tuple[tuple[str, str], ...]:
    pairs = tuple(metadata)
    if application is not None:
        pairs += ((APPLICATION_METADATA_KEY, application),)
    if api_key is not None:
        pairs += (("authorization", f"Bearer {api_key}"),)
    return pairs


RETRY_IN_MESSAGE = re.compile(r"; retry in (\d+(?:\.\d+)?) s$")
"""How the server's message ends when it says when to retry (cluster.api.tenants)."""


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """When the server said to retry: its `retry-after-ms` trailer, else the end of its message
    (Ray Serve's gRPC proxy drops trailing metadata from failed calls)."""
    trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailers:
        if key == RETRY_AFTER_METADATA_KEY and str(value).isdigit():
            return int(value) / 1000
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    said = RETRY_IN_MESSAGE.search(error.details() or "")
    return float(said.group(1)) if said else None


def _client_error(error: grpc.RpcError) -> TandemClientError:
    return TandemClientError(error.code(), error.details() or "", _retry_after_s(error))


@contextmanager
def _as_client_errors() -> Iterator[None]:
    """Raise a failed call's `grpc.RpcError` as a `TandemClientError` (blocking or asyncio)."""
    try:
        yield
    except grpc.RpcError as error:
        raise _client_error(error) from None


ResultT = TypeVar("ResultT")
StreamT = TypeVar("StreamT")


class _Client(Generic[ResultT, StreamT]):
    """What both clients share: the call settings, the metadata and timeout of each call, and
    turning a prompt and settings into the request (`build_request`). Each subclass makes the
    calls, blocking or asyncio: `_generate` and `stream_request`."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        application: str | None = None,
        api_key: str | None = None,
        own_connection: bool = False,
    ) -> None:
        """`own_connection`: a TCP connection of this client's own, never shared with another
        client's channel to the same address (gRPC shares one by default): servers that split
        a port's connections between them (the routers' own servers) then each get some."""
        self._timeout_s = timeout_s
        self._metadata = _call_metadata(metadata, application, api_key)
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self._channel = self._open_channel(address, options)
        self._stub = generate_pb2_grpc.TandemStub(self._channel)

    @staticmethod
    def _open_channel(address: str, options: list[tuple[str, Any]]) -> Any:
        """An insecure channel to `address` with gRPC channel `options`, blocking or asyncio."""
        raise NotImplementedError

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: ChatMessages | None = None,
        max_tokens: int,
        timeout_s: float | None = None,
        **settings: Unpack[RequestSettings],
    ) -> ResultT:
        """Generate the whole completion; settings left out, or None, mean the server's default
        (see `build_request`)."""
        request = partial(
            build_request, prompt, messages=messages, max_tokens=max_tokens, **settings
        )
        return self._generate(request, timeout_s)

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: ChatMessages | None = None,
        max_tokens: int,
        timeout_s: float | None = None,
        **settings: Unpack[RequestSettings],
    ) -> StreamT:
        """Chunks as the server commits tokens; the settings are checked before the call."""
        request = build_request(prompt, messages=messages, max_tokens=max_tokens, **settings)
        return self.stream_request(request, timeout_s=timeout_s)

    def _generate(
        self, request: Callable[[], generate_pb2.GenerateRequest], timeout_s: float | None
    ) -> ResultT:
        """`generate_request` on what `request()` builds: the asyncio client builds it inside
        its coroutine, so that a bad setting raises where the call is awaited."""
        raise NotImplementedError

    def stream_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> StreamT:
        """`stream` for a request message built by the caller (see `build_request`)."""
        raise NotImplementedError

    def _call_options(self, timeout_s: float | None, deadline: bool = False) -> dict[str, Any]:
        """A call's `timeout` (its own `timeout_s`, else the client's) and `metadata`; with
        `deadline` (Generate, GenerateStream), the metadata carries the timeout too."""
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        metadata = _timed(self._metadata, timeout) if deadline else self._metadata
        return {"timeout": timeout, "metadata": metadata}


class TandemClient(_Client[GenerateResult, Generator[StreamChunk, None, None]]):
    """A blocking client; use as a context manager or call `close()`."""

    @staticmethod
    def _open_channel(address: str, options: list[tuple[str, Any]]) -> Any:
        return grpc.insecure_channel(address, options=options)

    def _generate(
        self, request: Callable[[], generate_pb2.GenerateRequest], timeout_s: float | None
    ) -> GenerateResult:
        return self.generate_request(request(), timeout_s=timeout_s)

    def generate_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> GenerateResult:
        """`generate` for a request message built by the caller (see `build_request`)."""
        with _as_client_errors():
            response = self._stub.Generate(request, **self._call_options(timeout_s, deadline=True))
        return result_from_response(response)

    def stream_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> Generator[StreamChunk, None, None]:
        call = self._stub.GenerateStream(request, **self._call_options(timeout_s, deadline=True))
        try:
            with _as_client_errors():
                for chunk in call:
                    yield chunk_from_proto(chunk)
        finally:
            call.cancel()

    def audit_request(
        self,
        request: generate_pb2.GenerateRequest,
        *,
        dtype: str = "",
        timeout_s: float | None = None,
    ) -> generate_pb2.AuditResponse:
        """Serve `request`, replay it through the plain target on a verifier (`dtype` "": the
        replica's own weights; "float32": a float32 copy) and return the comparison
        (docs/audit.md). Greedy and seed-exact requests only: INVALID_ARGUMENT otherwise."""
        message = generate_pb2.AuditRequest(request=request, dtype=dtype)
        with _as_client_errors():
            response: generate_pb2.AuditResponse = self._stub.Audit(
                message, **self._call_options(timeout_s, deadline=True)
            )
        return response

    def cancel(self, request_id: str, *, timeout_s: float | None = None) -> None:
        """Cancel one of this tenant's running requests: its stream ends CANCELLED."""
        request = generate_pb2.CancelRequest(request_id=request_id)
        with _as_client_errors():
            self._stub.Cancel(request, **self._call_options(timeout_s))

    def usage(self, *, timeout_s: float | None = None) -> dict[str, int | str]:
        """This tenant's usage counters on the router replica that answers."""
        with _as_client_errors():
            usage = self._stub.GetUsage(
                generate_pb2.UsageRequest(), **self._call_options(timeout_s)
            )
        return usage_from_proto(usage)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncTandemClient(
    _Client[Coroutine[Any, Any, GenerateResult], AsyncGenerator[StreamChunk, None]]
):
    """An asyncio client; use as an async context manager or await `close()`."""

    @staticmethod
    def _open_channel(address: str, options: list[tuple[str, Any]]) -> Any:
        return grpc.aio.insecure_channel(address, options=options)

    async def _generate(
        self, request: Callable[[], generate_pb2.GenerateRequest], timeout_s: float | None
    ) -> GenerateResult:
        return await self.generate_request(request(), timeout_s=timeout_s)

    async def generate_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> GenerateResult:
        """`generate` for a request message built by the caller (see `build_request`)."""
        with _as_client_errors():
            response = await self._stub.Generate(
                request, **self._call_options(timeout_s, deadline=True)
            )
        return result_from_response(response)

    async def stream_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        call = self._stub.GenerateStream(request, **self._call_options(timeout_s, deadline=True))
        try:
            with _as_client_errors():
                async for chunk in call:
                    yield chunk_from_proto(chunk)
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
