"""Python clients of the public `tandem.v1.Tandem` API: `TandemClient` (blocking) and
`AsyncTandemClient` (asyncio, `grpc.aio`).

Both take a prompt as text or as token ids, plus the sampling and speculation settings, and
return plain frozen dataclasses: a `GenerateResult` for a whole generation, `StreamChunk`s for a
stream (the last chunk has the finish reason and a `RequestStats`). The server validates every
setting; the client only refuses values the wire cannot carry (a negative seed, an int past
int32), with INVALID_ARGUMENT like the server. Every failure, local or from the server, is a
`TandemClientError` carrying the gRPC status code and the server's message.

Deadlines: `timeout_s` on the client is the default for every call; a call's own `timeout_s`
overrides it. Leaving a stream early (break, or an exception in the loop) cancels the call, and
the server frees the request's sessions; for the async stream, close the iterator (e.g. with
`contextlib.aclosing`) to cancel at once.

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

import re
from collections.abc import AsyncGenerator, Generator, Sequence
from types import TracebackType

import grpc
import grpc.aio

from cluster.api.client_types import (
    GenerateResult,
    StreamChunk,
    TandemClientError,
    build_request,
    chunk_from_proto,
    result_from_response,
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


class TandemClient:
    """A blocking client; use as a context manager or call `close()`."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        application: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._metadata = _call_metadata(metadata, application, api_key)
        self._channel = grpc.insecure_channel(address)
        self._stub = generate_pb2_grpc.TandemStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        draft_tokens: int | None = None,
        pipelined: bool | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        """Generate the whole completion; None settings mean the server's default."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            draft_tokens=draft_tokens,
            pipelined=pipelined,
        )
        return self.generate_request(request, timeout_s=timeout_s)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        draft_tokens: int | None = None,
        pipelined: bool | None = None,
        timeout_s: float | None = None,
    ) -> Generator[StreamChunk, None, None]:
        """Chunks as the server commits tokens; the settings are checked before the call."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            draft_tokens=draft_tokens,
            pipelined=pipelined,
        )
        return self.stream_request(request, timeout_s=timeout_s)

    def generate_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> GenerateResult:
        """`generate` for a request message built by the caller (see `build_request`)."""
        try:
            response = self._stub.Generate(
                request, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _client_error(error) from None
        return result_from_response(response)

    def stream_request(
        self, request: generate_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> Generator[StreamChunk, None, None]:
        """`stream` for a request message built by the caller (see `build_request`)."""
        call = self._stub.GenerateStream(
            request, timeout=self._timeout(timeout_s), metadata=self._metadata
        )
        try:
            for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as error:
            raise _client_error(error) from None
        finally:
            call.cancel()

    def cancel(self, request_id: str, *, timeout_s: float | None = None) -> None:
        """Cancel one of this tenant's running requests: its stream ends CANCELLED."""
        try:
            self._stub.Cancel(
                generate_pb2.CancelRequest(request_id=request_id),
                timeout=self._timeout(timeout_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise _client_error(error) from None

    def usage(self, *, timeout_s: float | None = None) -> dict[str, int | str]:
        """This tenant's usage counters on the router replica that answers."""
        try:
            usage = self._stub.GetUsage(
                generate_pb2.UsageRequest(),
                timeout=self._timeout(timeout_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise _client_error(error) from None
        # Every counter, zeros included (ListFields would leave those out).
        return {field.name: getattr(usage, field.name) for field in usage.DESCRIPTOR.fields}

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

    def _timeout(self, timeout_s: float | None) -> float | None:
        return timeout_s if timeout_s is not None else self._timeout_s


class AsyncTandemClient:
    """An asyncio client; use as an async context manager or await `close()`."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        application: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._metadata = _call_metadata(metadata, application, api_key)
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generate_pb2_grpc.TandemStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        draft_tokens: int | None = None,
        pipelined: bool | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        """Generate the whole completion; None settings mean the server's default."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            draft_tokens=draft_tokens,
            pipelined=pipelined,
        )
        try:
            response = await self._stub.Generate(
                request, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _client_error(error) from None
        return result_from_response(response)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        draft_tokens: int | None = None,
        pipelined: bool | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Chunks as the server commits tokens; the settings are checked before the call."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            draft_tokens=draft_tokens,
            pipelined=pipelined,
        )
        return self._stream(request, self._timeout(timeout_s))

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

    async def _stream(
        self, request: generate_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncGenerator[StreamChunk, None]:
        call = self._stub.GenerateStream(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as error:
            raise _client_error(error) from None
        finally:
            call.cancel()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return timeout_s if timeout_s is not None else self._timeout_s
