"""The router replica's own servers: the public APIs with no Serve proxy between the client and
the router.

Through Serve's proxies every streamed chunk crosses two processes: the router replica pickles
it into Ray's object store and the proxy, in another process, reads it back and writes it to
the client; measured at 64 streams on `sim-h100-8b`, that is about a third of Tandem's CPU per
generated token (docs/benchmarks.md). `RouterFront` serves the same two APIs from the router
replica itself, as the drafter and verifier replicas already serve theirs. It is the default door
(on unless the config sets its ports to null): what `tandem serve` prints first (`--port`,
`--http-port`) and what the KubeRay `tandem` Service selects; Serve's proxies are the second.

- gRPC (`config.grpc_port`): `tandem.v1.Tandem` on the replica's `TandemService`, the
  standard health service and reflection, on a `grpc.aio` server with an event loop of its
  own (`cluster.serve.front_grpc.GrpcFront`): every stream's router loop runs on that loop as
  steps, awaiting each replica's answer instead of holding a thread, and writes each chunk to
  the client as it is committed. The client's gRPC deadline reaches the router directly
  (`time_remaining`); `x-tandem-deadline-ms` is not needed here.
- HTTP (`config.http_port`): the OpenAI-compatible API (`cluster.serve.http.OpenAIHttp`, the
  very object Serve's HTTP proxy calls) on a uvicorn server running its own event loop on a
  thread of this replica.

Both bind with SO_REUSEPORT, so every router replica on a node binds the same two ports and the
kernel spreads new connections over them: on Kubernetes a Service over the router pods' ports
reaches every router replica. Serve still places, scales and health-checks the replicas (the
front lives and dies with its replica: `close` stops both servers), and the Serve proxies' entry
keeps working beside it. A port already held by anything that did not set SO_REUSEPORT fails
the replica's start with the address in the error.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import h11
import uvicorn
from starlette.requests import Request
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from cluster.api.service import TandemService
from cluster.config import FrontConfig
from cluster.serve.front_grpc import GrpcFront
from cluster.serve.http import OpenAIHttp

HEALTH_WATCH_PERIOD_S = 1.0
STOP_GRACE_S = 5.0
"""How long `close` lets calls in flight finish before they are cancelled."""
HTTP_START_TIMEOUT_S = 30.0
STREAMS_PER_FRONT = 4096
"""Calls the gRPC server holds at once (they share one event loop and thread); one more is
answered RESOURCE_EXHAUSTED. The router's own queue (`max_running`, `max_queued`) is the
tighter limit in practice."""


class RouterFront:
    """The gRPC and HTTP servers of one router replica (see the module doc); `close` stops
    them."""

    def __init__(
        self,
        config: FrontConfig,
        service: TandemService,
        http: OpenAIHttp,
        healthy: Callable[[], bool],
    ) -> None:
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc: GrpcFront | None = None
        self._http: _HttpThread | None = None
        try:
            if config.grpc_port is not None:
                self._grpc = GrpcFront(
                    service, healthy, config.host, config.grpc_port, STREAMS_PER_FRONT, config
                )
                self.grpc_port = self._grpc.port
            if config.http_port is not None:
                self._http = _HttpThread(
                    http, config.host, config.http_port, config.header_timeout_s
                )
                self.http_port = self._http.port
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop both servers: new calls are refused, calls in flight get `STOP_GRACE_S`."""
        if self._grpc is not None:
            self._grpc.stop(STOP_GRACE_S)
            self._grpc = None
        if self._http is not None:
            self._http.stop()
            self._http = None


class _HeaderTimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 connection, closed when a request's headers do not all arrive within
    `header_timeout_s` of the connection's opening or of its last answer (uvicorn itself times
    out only an idle keep-alive connection, and not one that has sent part of its headers)."""

    header_timeout_s = FrontConfig.header_timeout_s
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request line and headers came
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # ready for the next request on this connection
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _HttpThread:
    """`OpenAIHttp` on a uvicorn server with its own event loop, on a thread of its own."""

    def __init__(
        self,
        http: OpenAIHttp,
        host: str,
        port: int,
        header_timeout_s: float = FrontConfig.header_timeout_s,
    ) -> None:
        self._socket = _reusable_socket(host, port)
        self.port: int = self._socket.getsockname()[1]

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":  # websockets: not served
                return
            response = await http(Request(scope, receive))
            await response(scope, receive, send)

        protocol = type(
            "HeaderTimedH11", (_HeaderTimedH11,), {"header_timeout_s": header_timeout_s}
        )
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, lifespan="off", log_level="warning", access_log=False, http=protocol
            )
        )
        self._thread = threading.Thread(
            target=self._run, name=f"http-front-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + HTTP_START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP front on {host}:{port} did not start")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(STOP_GRACE_S + 5.0)
        self._socket.close()


def _reusable_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` with SO_REUSEPORT (see the module doc)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as error:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP front to {host}:{port}: {error}") from error
    sock.set_inheritable(True)
    return sock
