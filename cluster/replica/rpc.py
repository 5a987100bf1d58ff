"""What the drafter and verifier gRPC servicers share: call handling and the server.

- `CallGuard` turns what a servicer's handlers raise into a gRPC status: a `TandemError`
  becomes its own code (`cluster.wire.status.status_code`) with its message (a retry hint as
  `retry-after-ms` trailing metadata); anything else becomes INTERNAL with a fixed message, its
  traceback logged here and never sent to the client.
- `start_server` starts a sync gRPC server on a thread pool and returns the port it bound. A
  handler only waits for the replica's engine (which batches every waiting call into one
  forward pass), so the pool is as large as the calls the server holds: it never caps the batch.
  It holds at most `max_concurrent_rpcs` calls at once, running or queued, and answers
  RESOURCE_EXHAUSTED to one more. That bounds the calls, not the work one call brings: a
  Frames stream bounds its own (`cluster.replica.stream_limits`; below). Given the
  cluster's shared secret, it answers UNAUTHENTICATED to every call that does not carry it
  (`SecretCheck`; a Frames stream as well as a unary call), so nothing but the router can drive
  a replica; and it parses each request itself (`ParseCheck`), so bytes that are not the
  method's message get INVALID_ARGUMENT rather than gRPC's own INTERNAL (on a stream: a frame
  that is not a RouterFrame ends that stream with INVALID_ARGUMENT). A stream counts as one
  call against `max_concurrent_rpcs`, however many sessions its frames carry; a frame larger
  than `MAX_MESSAGE_BYTES` ends its stream with RESOURCE_EXHAUSTED (gRPC's own check), one with
  more than `MAX_FRAME_ENTRIES` entries with INVALID_ARGUMENT; an entry read while its stream
  has `MAX_PENDING_ENTRIES` unanswered is refused alone (RESOURCE_EXHAUSTED); a router that
  leaves more than `MAX_UNSENT_RESULTS` results unread has its stream cancelled.

Both servicers are thin adapters over a plain component (docs/architecture.md, "Layers"): they
convert with `cluster.wire`'s conversions, call the component inside `CallGuard.run`, and
convert the result back.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, NoReturn, TypeVar

import grpc

from cluster.runtime.call_scope import call_scope
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.runtime.limits import DEFAULT_MAX_SESSIONS
from cluster.wire.metadata import (
    MESSAGE_SIZE_OPTIONS,
    RETRY_AFTER_METADATA_KEY,
    SECRET_METADATA_KEY,
)
from cluster.wire.status import put_status, status_code

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error; see the replica's log"
"""The only details a client gets for an unexpected server-side exception."""

DEFAULT_MAX_CONCURRENT_RPCS = 2 * DEFAULT_MAX_SESSIONS
"""Calls a server holds at once, running or waiting for a worker (512); one more is answered
RESOURCE_EXHAUSTED. A router has at most one call in flight per session on each side (a
verify, or a draft or an open), and a replica holds at most `DEFAULT_MAX_SESSIONS` sessions
by default (`max_sessions`), so twice that leaves room for closes and stats under full load;
a flood beyond it is refused at once instead of queueing without bound."""

DEFAULT_MAX_WORKERS = DEFAULT_MAX_CONCURRENT_RPCS
"""Handler threads: one per call held. A handler blocks on the engine's result (no GIL, no
compute), the pool starts threads only as calls arrive, and a smaller pool would cap the batch
the engine can form."""

R = TypeVar("R")


def _abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailers: tuple[tuple[str, str], ...] = (),
) -> NoReturn:
    context.abort(*put_status(context, code, details, trailers))
    # context.abort always raises; this line only tells the type checker so.
    raise AssertionError("grpc.ServicerContext.abort returned")


class CallGuard:
    """Runs a servicer's handlers, turning exceptions into gRPC statuses.

    Handlers run concurrently: the components (`Drafter`, `Verifier`) hand every call to their
    engine's thread, which alone touches sessions and the model, and batches the calls that
    wait into one forward pass.
    """

    def __init__(self, component_name: str) -> None:
        self._component_name = component_name

    def run(self, context: grpc.ServicerContext, method: str, call: Callable[[], R]) -> R:
        """Return `call()`; abort the RPC with the matching status if it raises. If the caller
        goes (the RPC is cancelled, times out or loses its connection) while `call` waits on the
        engine, the engine drops its work before the next step (`call_scope`)."""
        gone = threading.Event()
        if not context.add_callback(gone.set):
            gone.set()  # the RPC has already ended
        try:
            with call_scope(gone):
                return call()
        except TandemError as error:
            retry_after_s = getattr(error, "retry_after_s", None)
            trailers: tuple[tuple[str, str], ...] = ()
            if retry_after_s is not None:
                milliseconds = str(max(1, round(retry_after_s * 1000)))
                trailers = ((RETRY_AFTER_METADATA_KEY, milliseconds),)
            _abort(context, status_code(error.status), str(error), trailers)
        except Exception:
            logger.exception("%s.%s failed unexpectedly", self._component_name, method)
            _abort(context, grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE)


class SecretCheck(grpc.ServerInterceptor):
    """Lets a call through only if its metadata carries the shared secret (compared in
    constant time); every other call is answered UNAUTHENTICATED before any handler runs, its
    payload never parsed. The secret itself is never logged or echoed."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self._secret = secret.encode()
        # A refusal of the method's own kind: gRPC answers a streaming method served by a
        # unary handler with its own error, not UNAUTHENTICATED.
        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(self._unauthenticated),
            (False, True): grpc.unary_stream_rpc_method_handler(self._unauthenticated),
            (True, False): grpc.stream_unary_rpc_method_handler(self._unauthenticated),
            (True, True): grpc.stream_stream_rpc_method_handler(self._unauthenticated),
        }

    @staticmethod
    def _unauthenticated(request: Any, context: grpc.ServicerContext) -> NoReturn:
        _abort(
            context,
            grpc.StatusCode.UNAUTHENTICATED,
            f"internal API: missing or wrong {SECRET_METADATA_KEY}",
        )

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == SECRET_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._secret):
                    return continuation(handler_call_details)
        handler = continuation(handler_call_details)  # looked up, never run
        if handler is None:
            return self._refusals[False, False]
        return self._refusals[bool(handler.request_streaming), bool(handler.response_streaming)]


class ParseCheck(grpc.ServerInterceptor):
    """Parses each request in the handler instead of in gRPC: a payload that is not the
    method's message is answered INVALID_ARGUMENT (gRPC itself would answer INTERNAL, "Exception
    deserializing request!"), and the servicer sees only parsed messages. On a streaming
    request the handler's request iterator raises `InvalidArgumentError` at the first frame
    that does not parse, and the handler ends the stream with it (`SessionServicer.Frames`)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method
        if handler.request_streaming:
            return _parsed_stream(handler, parse, method)

        def parsed(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: the payload is not a valid request message",
                )

        if handler.response_streaming:
            stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                lambda raw, context: stream(parsed(raw, context), context),
                response_serializer=handler.response_serializer,
            )
        unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, context: unary(parsed(raw, context), context),
            response_serializer=handler.response_serializer,
        )


def _parsed_stream(handler: Any, parse: Callable[[bytes], Any], method: str) -> Any:
    """`handler` (a streaming-request one) over raw frames that it parses itself."""

    def frames(raw_frames: Any) -> Any:
        for raw in raw_frames:
            try:
                message = parse(raw)
            except Exception:
                raise InvalidArgumentError(
                    f"{method}: a frame is not a valid request message"
                ) from None
            yield message

    if handler.response_streaming:
        stream = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            lambda raw_frames, context: stream(frames(raw_frames), context),
            response_serializer=handler.response_serializer,
        )
    unary = handler.stream_unary
    return grpc.stream_unary_rpc_method_handler(
        lambda raw_frames, context: unary(frames(raw_frames), context),
        response_serializer=handler.response_serializer,
    )


def start_server(
    add_servicer: Callable[[grpc.Server], None],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    secret: str | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    reuse_port: bool = False,
) -> tuple[grpc.Server, int]:
    """Start an insecure gRPC server with the servicers `add_servicer` registers on it.

    `port` 0 picks a free port. `max_concurrent_rpcs`: calls held at once, running or queued;
    one more is answered RESOURCE_EXHAUSTED (a stream counts until it ends). Returns the
    running server and the port it bound; raises RuntimeError if the address cannot be bound
    (a port in use is not shared: SO_REUSEPORT is off, so two replicas can never silently split
    one port's traffic), unless `reuse_port`: then every server of this machine that binds the
    same port with it shares the port's connections (the router replicas' public front,
    `cluster.serve.front`). Stop it with `server.stop(grace_s)`. With `secret`, only calls that
    carry it are served (`SecretCheck`).
    """
    if max_concurrent_rpcs < 1:
        raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="replica-rpc"),
        interceptors=[
            *([SecretCheck(secret)] if secret is not None else []),
            ParseCheck(),
            *interceptors,
        ],
        options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", int(reuse_port))],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    add_servicer(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as error:
        server.stop(None)
        raise RuntimeError(f"cannot bind a gRPC server to {address}: {error}") from error
    server.start()
    return server, int(bound_port)
