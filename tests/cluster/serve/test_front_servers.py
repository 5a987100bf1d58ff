"""The router front's servers alone, without Ray (`cluster.serve.front`): both bind with
SO_REUSEPORT so that every router replica of a node shares the ports, refuse a port held
without it, and stop cleanly."""

from __future__ import annotations

import socket

import grpc
import httpx2
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from cluster.replica.rpc import start_server
from cluster.serve.front import _HttpThread
from cluster.serve.loopback import free_port, port_is_free


def no_servicer(server: grpc.Server) -> None:
    pass


def test_grpc_servers_share_a_port_only_when_both_ask() -> None:
    port = free_port()
    first, bound = start_server(no_servicer, port=port, reuse_port=True)
    second, again = start_server(no_servicer, port=port, reuse_port=True)
    try:
        assert bound == again == port
        with pytest.raises(RuntimeError, match="cannot bind"):
            start_server(no_servicer, port=port)  # a replica's server never shares
    finally:
        first.stop(None)
        second.stop(None)


class Answer:
    """An `OpenAIHttp` stand-in: answers every request with its path."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def __call__(self, request: Request) -> Response:
        return PlainTextResponse(f"{self.name} {request.url.path}")


def test_http_servers_share_a_port_answer_and_stop() -> None:
    port = free_port()
    servers = [_HttpThread(Answer(name), "127.0.0.1", port) for name in ("a", "b")]  # type: ignore[arg-type]
    try:
        assert {s.port for s in servers} == {port}
        with httpx2.Client(timeout=10) as http:
            answers = {http.get(f"http://127.0.0.1:{port}/v1/models").text for _ in range(20)}
        assert answers <= {"a /v1/models", "b /v1/models"} and answers
    finally:
        for server in servers:
            server.stop()
    assert port_is_free(port)


def test_an_http_port_held_without_reuse_is_refused_with_its_address() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            _HttpThread(Answer("a"), "127.0.0.1", port)  # type: ignore[arg-type]
    finally:
        holder.close()
