"""Loopback ports for the service's servers: pick one free now, never one the kernel may hand
to an outgoing connection first, and wait for ports to be let go.

`free_port` picks from `SERVER_PORTS` (narrowed per process by `SERVER_PORTS_ENV`), outside the
kernel's ephemeral range, and never twice in one process (`reserve_ports` keeps a user's named
ports out). `free_door_ports` and `port_arguments` give a tool's own `tandem serve` a free port
for each of its four doors (`PORT_FLAGS`), the proxies' included: one above a free port, their
default, is free only by chance. Plain sockets and environment variables: no Ray.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from cluster.runtime.errors import InvalidArgumentError

LOOPBACK = "127.0.0.1"

SERVER_PORTS = range(20000, 32768)
"""Where `free_port` picks from: above Ray's worker ports (10002-19999 by default) and below the
kernel's ephemeral range (32768-60999 by default). A port the kernel hands out for `bind(0)` is
an ephemeral one, which any outgoing connection (Ray's processes open hundreds while a cluster
starts) may take between the pick and the server's bind."""
SERVER_PORTS_ENV = "TANDEM_SERVER_PORTS"
"""Narrows `SERVER_PORTS` to `LOW-HIGH` (inclusive) for this process and the processes it starts:
two services started at once on one machine by different processes (parallel test workers, two
operators) then never pick the same port, which `_handed_out` only rules out within a process."""
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLAGS = ("--port", "--http-port", "--proxy-port", "--proxy-http-port")
"""The flags that set the four public ports: the routers' own gRPC and HTTP servers (the
default door), Serve's gRPC and HTTP proxies (the second door)."""
_handed_out: set[int] = set()
"""Ports this process has picked already: two picks before either is bound never agree."""


def free_port() -> int:
    """A loopback port free now, for a server about to listen on it (see `SERVER_PORTS`)."""
    low, high = _ephemeral_range()
    candidates = [p for p in server_ports() if not low <= p <= high and p not in _handed_out]
    rng = random.SystemRandom()  # concurrent processes must not walk the same sequence
    for _ in range(min(len(candidates), 256)):
        port = rng.choice(candidates)
        if port_is_free(port):
            _handed_out.add(port)
            return port
    with socket.socket() as probe:  # none outside the ephemeral range: the kernel's pick
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def free_door_ports() -> dict[str, int]:
    """A free loopback port for each of `PORT_FLAGS` (`loopback.free_port`, four different
    ones): for the `tandem serve` a tool starts beside whatever else runs on this machine. Each
    is named, since a proxy's default (one above the router's port) is free only by chance."""
    return {flag: free_port() for flag in PORT_FLAGS}


def port_arguments(ports: dict[str, int]) -> list[str]:
    """`tandem serve`'s flags for `ports` (`free_door_ports`): `--port 20123 ...`."""
    return [text for flag, port in ports.items() for text in (flag, str(port))]


def reserve_ports(*ports: int) -> None:
    """Never hand out `ports` from `free_port` in this process: the ports a user named for the
    service's own servers, which the cluster started for it must not take first."""
    _handed_out.update(ports)


def server_ports() -> range:
    """`SERVER_PORTS`, or the part of it `SERVER_PORTS_ENV` names."""
    text = os.environ.get(SERVER_PORTS_ENV, "").strip()
    if not text:
        return SERVER_PORTS
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise InvalidArgumentError(
            f"{SERVER_PORTS_ENV}={text!r}: expected LOW-HIGH, e.g. 20000-26383"
        ) from None
    if not SERVER_PORTS.start <= low <= high < SERVER_PORTS.stop:
        raise InvalidArgumentError(
            f"{SERVER_PORTS_ENV}={text!r}: the range must lie within "
            f"{SERVER_PORTS.start}-{SERVER_PORTS.stop - 1}"
        )
    return range(low, high + 1)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` now (as servers do, with SO_REUSEADDR, so that
    connections of a server just closed, in TIME_WAIT, do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def wait_ports_free(ports: Sequence[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for every port to be free; returns those still held."""
    deadline = time.monotonic() + timeout_s
    held = [port for port in ports if not port_is_free(port)]
    while held and time.monotonic() < deadline:
        time.sleep(0.1)
        held = [port for port in held if not port_is_free(port)]
    return held
