"""What the drafter and verifier gRPC servicers share: status codes, call handling, the server.

- `status_code` maps a `TandemError.status` name to its `grpc.StatusCode`.
- `CallGuard` runs a servicer's handlers one at a time and turns what they raise into a gRPC
  status: a `TandemError` becomes its own code with its message; anything else becomes
  INTERNAL with a fixed message, its traceback logged here and never sent to the client.
- `start_server` starts a sync gRPC server on a thread pool and returns the port it bound.

Both servicers are thin adapters over a plain component (STYLE.md, three layers): they convert
with `verifier.wire`, call the component inside `CallGuard.run`, and convert the result back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc

from verifier.errors import TandemError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message a replica server or client sends or accepts. A block of 32 tokens, each with
an untruncated q over a 150k vocabulary, is over 30 MiB; gRPC's default limit is 4 MiB."""

MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
"""Channel and server options that apply `MAX_MESSAGE_BYTES`."""

INTERNAL_ERROR_MESSAGE = "internal error; see the replica's log"
"""The only details a client gets for an unexpected server-side exception."""

DEFAULT_MAX_WORKERS = 8

R = TypeVar("R")


def status_code(status: str) -> grpc.StatusCode:
    """The code named by a `TandemError.status` (a `grpc.StatusCode` member name).

    An unknown name maps to INTERNAL: a typo in an error class must not become a wrong but
    plausible code.
    """
    return grpc.StatusCode.__members__.get(status, grpc.StatusCode.INTERNAL)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    # context.abort always raises; this line only tells the type checker so.
    raise AssertionError("grpc.ServicerContext.abort returned")


class CallGuard:
    """Runs one servicer's handlers one at a time, turning exceptions into gRPC statuses.

    The components (`Drafter`, `Verifier`) are not thread-safe: a call mutates a session's
    tokens, KV cache and generator, and the session table itself. A sync gRPC server runs
    handlers on a thread pool, so every call into the component, conversions included, holds
    this guard's lock. One lock per component is enough: its calls are compute-bound on one
    model, so running two at once would not make either faster.
    """

    def __init__(self, component_name: str) -> None:
        self._component_name = component_name
        self._lock = threading.Lock()

    def run(self, context: grpc.ServicerContext, method: str, call: Callable[[], R]) -> R:
        """Return `call()`; abort the RPC with the matching status if it raises."""
        try:
            with self._lock:
                return call()
        except TandemError as error:
            _abort(context, status_code(error.status), str(error))
        except Exception:
            logger.exception("%s.%s failed unexpectedly", self._component_name, method)
            _abort(context, grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE)


def start_server(
    add_servicer: Callable[[grpc.Server], None],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> tuple[grpc.Server, int]:
    """Start an insecure gRPC server with the servicers `add_servicer` registers on it.

    `port` 0 picks a free port. Returns the running server and the port it bound; raises
    RuntimeError if the address cannot be bound (a port in use is not shared: SO_REUSEPORT is
    off, so two replicas can never silently split one port's traffic). Stop it with
    `server.stop(grace_s)`.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="replica-rpc"),
        options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)],
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
