"""The two doors of `tandem serve`: which four public ports it serves on, and how they read.

The default door is the router replicas' own servers (`--port`, default 9000: gRPC;
`--http-port`, default 8000: the OpenAI-compatible HTTP API); the second is Serve's proxies
(`--proxy-port`, default `--port` + 1; `--proxy-http-port`, default the HTTP port + 1).
`proxy_grpc_port` and `proxy_http_port` choose the proxies' ports from the flags and the config,
`public_ports` lists every port a config serves on with the flag that sets it, and
`check_ports_free` refuses one in use or given twice, naming that flag (`InvalidArgumentError`).
`door_lines`, `grpc_address` and `http_address` are the addresses as `tandem serve` and
`tandem status` print them. Plain functions: only `check_ports_free` probes the machine.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cluster.runtime.errors import InvalidArgumentError
from cluster.serve import loopback, ray_cluster
from cluster.serve.loopback import PORT_FLAGS

if TYPE_CHECKING:
    from cluster.config import FrontConfig, TandemConfig

DEFAULT_PROXY_HTTP_PORT = 8001
"""Serve's HTTP proxy where the routers serve no HTTP of their own (`front.http_port: null`)
and no flag names one; otherwise the routers' HTTP port + 1."""


def port_number(text: str) -> int:
    """A port flag's value: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1..65535)")
    return port


def proxy_grpc_port(args: argparse.Namespace, config: TandemConfig, front: FrontConfig) -> int:
    """Serve's gRPC proxy: `--proxy-port`, else the config's `proxy_grpc_port` where it sets one
    of its own, else one above the routers' gRPC port (9001 by default)."""
    from cluster.config import DEFAULT_PROXY_GRPC_PORT

    if args.proxy_port is not None:
        return int(args.proxy_port)
    if config.proxy_grpc_port != DEFAULT_PROXY_GRPC_PORT or front.grpc_port is None:
        return config.proxy_grpc_port
    return front.grpc_port + 1


def proxy_http_port(args: argparse.Namespace, config: TandemConfig) -> int:
    """Serve's HTTP proxy: `--proxy-http-port`, else one above the routers' HTTP port."""
    if args.proxy_http_port is not None:
        return int(args.proxy_http_port)
    http_port = config.front.http_port
    return DEFAULT_PROXY_HTTP_PORT if http_port is None else http_port + 1


def public_ports(config: TandemConfig, proxy_http_port: int) -> list[tuple[int, str]]:
    """The public ports `config` serves on, each with the flag that sets it (`PORT_FLAGS`):
    the routers' own (none where the config turns one off), then Serve's proxies."""
    ports = (config.front.grpc_port, config.front.http_port, config.proxy_grpc_port,
             proxy_http_port)  # fmt: skip
    return [(port, flag) for port, flag in zip(ports, PORT_FLAGS, strict=True) if port]


def check_ports_free(ports: list[tuple[int, str]]) -> None:
    """Every public port differs from the others and is free, else the error names the flag
    that sets it. As the servers bind them (SO_REUSEADDR): a port whose last server just
    stopped is free, its closed connections in TIME_WAIT notwithstanding; one a server listens
    on is not."""
    flags: dict[int, str] = {}
    for port, flag in ports:
        if port in flags:
            raise InvalidArgumentError(
                f"{flags[port]} and {flag} are both port {port}; give each its own"
            )
        flags[port] = flag
        if not loopback.port_is_free(port):
            raise InvalidArgumentError(f"port {port} is in use; choose another with {flag}")


def door_lines(state: ray_cluster.ClusterState) -> list[str]:
    """What `tandem serve` prints once the service is up: the default door first (the routers'
    own servers: the gRPC API, then the OpenAI-compatible API's base URL), then the second
    (Serve's proxies)."""
    lines = []
    if state.grpc_port:
        lines.append(f"gRPC API on {grpc_address(state.grpc_port)} (tandem.v1.Tandem)")
    if state.http_port:
        lines.append(f"OpenAI-compatible API on {http_address(state.http_port)}")
    proxies = [
        *([f"gRPC {grpc_address(state.proxy_port)}"] if state.proxy_port else []),
        *([f"HTTP {http_address(state.proxy_http_port)}"] if state.proxy_http_port else []),
    ]
    if proxies:
        lines.append(f"through Serve's proxies: {', '.join(proxies)}")
    return lines


def grpc_address(port: int | None) -> str:
    """The gRPC API's address on this machine (what `--address` takes)."""
    return f"{loopback.LOOPBACK}:{port}"


def http_address(port: int | None) -> str:
    """The OpenAI-compatible API's base URL on this machine (what OpenAI clients take)."""
    return f"http://{loopback.LOOPBACK}:{port}/v1"
