"""OpenAI-compatible HTTP on the router ingress: a starlette `Request` in, a response out.

Serve's HTTP proxy calls the ingress deployment's `__call__` with the request; `RouterIngress`
hands it to `OpenAIHttp`, which routes it to `cluster.api.openai.OpenAIService` (the same
TandemService, router and tenants as the gRPC API) and frames what comes back:

- `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, and Tandem's own
  `POST /v1/audit` (a completions body plus `audit_dtype`, answered with the audit's report as
  JSON: `cluster.api.audit`), paths relative to the application's route prefix; any other
  path is 404 and a known path with another method is 405 (with `Allow`), both in OpenAI's
  error shape (`{"error": {"message", "type", "param", "code"}}`), as is every other error
  (`cluster.api.openai.error_response` picks the status).
- Probes, as vLLM serves them, open to every caller (no API key, so that load balancers and
  Prometheus need none), only when the face has `ServerProbes`: `GET /health` (200 with an
  empty body while the service can serve, 503 otherwise), `GET /version` (`{"version": ...}`,
  the installed `tandem` package's) and `GET /metrics` (Tandem's metrics in Prometheus' text
  format, `text/plain; version=0.0.4`).
- The caller is authenticated before the body is read (401 for a missing or unknown key). The
  body is then read within `body_timeout_s` (408 for one that does not come whole in time: a
  half-sent request holds nothing longer) and at most `max_body_bytes` of it (413 past that,
  whatever `Content-Length` says or does not say); both are `FrontConfig` fields (30 s, 4 MiB)
  and hold on both doors. A body over `LOOP_PARSE_BYTES` is parsed on the thread pool, not on
  the loop that serves every stream.
- The body must be a JSON object of Unicode text nested at most 64 levels
  (`cluster.api.json_body`): anything else is 400 before the service sees it.
- The caller: `Authorization: Bearer <key>` and the optional `x-tandem-deadline-ms` header,
  read exactly as the gRPC ingress reads the same metadata (`cluster.serve.calls.deadline_of`).
- Unary: a `JSONResponse`. The router loop blocks, so the call runs on the ingress's thread
  pool; if Serve cancels the request (the client went away) the thread stops the generation
  after the step in flight (`is_active`).
- `"stream": true`: server-sent events, `data: <chunk json>\\n\\n` per chunk and
  `data: [DONE]\\n\\n` at the end (`text/event-stream`). The stream is opened on the thread
  pool (authentication, checks, tokenization: `OpenAIService.open_stream`), and its steps run on
  the event loop (`cluster.serve.calls.stream_merged`), which merges what a lagging client has
  pending into one chunk (`cluster.api.response.coalesce`) before it is
  made into event bodies (`cluster.api.openai_stream.ChunkBodies`), the events of one merged
  chunk written at once: a client that reads slowly gets fewer, larger events with the same
  text, and the proxy carries fewer chunks. The first chunk is awaited before the response
  starts, so an error before it (authentication, validation, a quota) is an ordinary error
  response with its status; an error after it can only be told in the stream: one
  `data: {"error": ...}` event, and the stream ends without `[DONE]`. Ending the response in
  any way (finished, failed, or cancelled because the client disconnected) closes the Tandem
  stream, which frees the request's sessions on both replicas: starlette leaves an unfinished
  body iterator open when its send is cancelled, so `_ClosingStream` closes it itself.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import threading
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Literal, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.api.caller import Caller
from cluster.api.json_body import parse_json_object
from cluster.api.openai import OpenAIService, Route, error_response
from cluster.api.openai_stream import ChunkBodies
from cluster.api.response import ApiChunk, coalesce
from cluster.api.tenants import bearer_key
from cluster.config import FrontConfig
from cluster.serve.calls import deadline_of, stream_merged

logger = logging.getLogger(__name__)

AUDIT: Final = "audit"
ROUTES: dict[str, tuple[str, Route | Literal["audit"] | None]] = {
    "/v1/models": ("GET", None),
    "/v1/completions": ("POST", "completions"),
    "/v1/chat/completions": ("POST", "chat.completions"),
    "/v1/audit": ("POST", AUDIT),
}
"""Path -> (its one method, the OpenAIService route; None: the model list; "audit": Tandem's
audit, `OpenAIService.audit`)."""
PROBES = ("/health", "/version", "/metrics")
"""Paths answered without authentication, all `GET` (`ServerProbes`)."""
DONE_EVENT = b"data: [DONE]\n\n"
EVENT_STREAM = "text/event-stream"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
PACKAGE = "tandem"
LOOP_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop; larger ones on the thread pool."""


class BodyError(Exception):
    """A request body refused before it is parsed: `status` 413 or 408."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ServerProbes(Protocol):
    """What the probe paths report; both calls may block (they run on the thread pool)."""

    def healthy(self) -> bool:
        """Whether the service can serve a request now."""
        ...

    def metrics_text(self) -> str:
        """Tandem's metrics in Prometheus' text exposition format."""
        ...


def package_version() -> str:
    """The installed `tandem` package's version ("unknown" when it is not installed)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OpenAIHttp:
    """The HTTP face of `OpenAIService`; blocking work runs on `threads` (the ingress's).
    `probes`: what `/health` and `/metrics` report (None: the probe paths are unknown, as
    for the API alone)."""

    def __init__(
        self,
        openai: OpenAIService,
        threads: ThreadPoolExecutor,
        probes: ServerProbes | None = None,
        max_body_bytes: int = FrontConfig.max_body_bytes,
        body_timeout_s: float = FrontConfig.body_timeout_s,
    ) -> None:
        self._openai = openai
        self._threads = threads
        self._probes = probes
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s

    async def __call__(self, request: Request) -> Response:
        path = _route_path(request.scope)
        if path in PROBES and self._probes is not None:
            if request.method != "GET":
                return _error_json(
                    405, f"{path} takes GET, not {request.method}",
                    code="method_not_allowed", headers={"Allow": "GET"},
                )  # fmt: skip
            return await self._probe(path, self._probes)
        if path not in ROUTES:
            return _error_json(404, f"unknown path {path!r}", code="unknown_url")
        method, route = ROUTES[path]
        if request.method != method:
            return _error_json(
                405,
                f"{path} takes {method}, not {request.method}",
                code="method_not_allowed",
                headers={"Allow": method},
            )
        try:
            caller = _caller(request)
            if route is None:
                return JSONResponse(self._openai.models(caller))
            self._openai.authenticate(caller)  # before a byte of the body is read
            body = await self._json_object(request)
            if route == AUDIT:
                return JSONResponse(await self._audit(body, caller))
            if self._openai.wants_stream(body):
                return await self._stream(route, body, caller)
            return JSONResponse(await self._complete(route, body, caller))
        except asyncio.CancelledError:
            raise
        except BodyError as error:
            return _error_json(error.status, str(error), code=error.code)
        except Exception as error:
            return _error(error)

    async def _json_object(self, request: Request) -> dict[str, Any]:
        """The body, read within the time and size limits, parsed as a JSON object."""
        raw = await self._body(request)
        if len(raw) <= LOOP_PARSE_BYTES:
            return parse_json_object(raw)
        return await asyncio.wrap_future(self._threads.submit(parse_json_object, raw))

    async def _body(self, request: Request) -> bytes:
        limit = self._max_body_bytes
        too_large = BodyError(
            413, f"the request body is larger than {limit} bytes", "request_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        try:
            async with asyncio.timeout(self._body_timeout_s):
                async for part in request.stream():
                    size += len(part)
                    if size > limit:
                        raise too_large
                    parts.append(part)
        except TimeoutError:
            raise BodyError(
                408, f"the request body did not arrive within {self._body_timeout_s} s",
                "request_timeout",
            ) from None  # fmt: skip
        return b"".join(parts)

    async def _probe(self, path: str, probes: ServerProbes) -> Response:
        """A probe's answer; a probe that fails is 503 (health) or 500, never a traceback."""
        try:
            if path == "/version":
                return JSONResponse({"version": package_version()})
            if path == "/health":
                healthy = await asyncio.wrap_future(self._threads.submit(probes.healthy))
                return Response(status_code=200 if healthy else 503)
            text = await asyncio.wrap_future(self._threads.submit(probes.metrics_text))
            return Response(text, media_type=PROMETHEUS_TEXT)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if path == "/health":
                logger.warning("the health check failed: %s", error)
                return Response(status_code=503)
            return _error(error)

    async def _complete(self, route: Route, body: object, caller: Caller) -> dict[str, Any]:
        active = threading.Event()
        active.set()
        future = self._threads.submit(self._openai.complete, route, body, caller, active.is_set)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            active.clear()  # the thread ends the generation after the step in flight
            raise

    async def _audit(self, body: object, caller: Caller) -> dict[str, Any]:
        active = threading.Event()
        active.set()
        future = self._threads.submit(self._openai.audit, body, caller, active.is_set)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            active.clear()  # the thread ends the generation after the step in flight
            raise

    async def _stream(self, route: Route, body: object, caller: Caller) -> Response:
        opening = self._threads.submit(self._openai.open_stream, route, body, caller)
        steps, bodies = await asyncio.wrap_future(opening)
        chunks = stream_merged(steps, self._threads, coalesce)
        try:
            # An error raised here is answered as a whole response; `chunks` closed itself.
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        return _ClosingStream(_events(first, chunks, bodies))


async def _events(
    first: ApiChunk | None, chunks: AsyncGenerator[ApiChunk, None], bodies: ChunkBodies
) -> AsyncGenerator[bytes, None]:
    """The response body: `first`, then the rest of `chunks`, as events (those of a chunk
    sent as one write); `[DONE]` unless a chunk failed, which is told as one error event.
    Closing this closes `chunks`."""
    try:
        if first is not None:
            data = _events_of(bodies, first)
            if data:
                yield data
            async for chunk in chunks:
                data = _events_of(bodies, chunk)
                if data:  # a chunk of no new text (an incomplete character) says nothing
                    yield data
    except Exception as error:
        _, body, _ = error_response(error)
        yield _event(body)
        return
    finally:
        await chunks.aclose()
    yield DONE_EVENT


class _ClosingStream(StreamingResponse):
    """A `StreamingResponse` that closes its body iterator however the response ends: on a
    client disconnect Serve cancels the request, possibly while starlette awaits `send` between
    two chunks, and starlette would then leave the iterator (and the Tandem stream) open."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type=EVENT_STREAM)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def _route_path(scope: Scope) -> str:
    """The request's path below the application's route prefix (Serve sets `root_path`)."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "")).rstrip("/")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def _caller(request: Request) -> Caller:
    headers = request.headers.items()
    return Caller(bearer_key(headers), deadline_of(headers))


def _events_of(bodies: ChunkBodies, chunk: ApiChunk) -> bytes:
    return b"".join(_event(body) for body in bodies.bodies(chunk))


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _error(error: Exception) -> JSONResponse:
    status, body, headers = error_response(error)
    return JSONResponse(body, status_code=status, headers=headers)


def _error_json(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": body}, status_code=status, headers=headers)
