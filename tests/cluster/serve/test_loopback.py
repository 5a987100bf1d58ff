"""The ports the service's servers are given: free, outside the kernel's ephemeral range, within
the range the environment names, never handed out twice."""

from __future__ import annotations

import pytest

from cluster.runtime.errors import InvalidArgumentError
from cluster.serve import loopback


def test_free_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    """A server's port is picked where no outgoing connection can take it before the server
    binds it (the ephemeral range), and never twice in one process."""
    low, high = loopback._ephemeral_range()
    ports = [loopback.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port in loopback.server_ports() and not low <= port <= high
        assert loopback.port_is_free(port)


def test_free_ports_stay_in_the_range_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Processes given disjoint ranges (parallel test workers) never pick the same port."""
    monkeypatch.setenv(loopback.SERVER_PORTS_ENV, "21000-21099")
    ports = [loopback.free_port() for _ in range(20)]
    assert all(21000 <= port <= 21099 for port in ports)


@pytest.mark.parametrize("text", ["21000", "a-b", "19000-21000", "21000-40000", "22000-21000"])
def test_a_bad_port_range_is_refused_with_its_name(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(loopback.SERVER_PORTS_ENV, text)
    with pytest.raises(InvalidArgumentError, match=loopback.SERVER_PORTS_ENV):
        loopback.free_port()


def test_reserved_ports_are_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tandem serve --port P --http-port H` reserves P and H before Ray's servers get ports,
    so the cluster it starts cannot take them (a restart on the same ports once failed so)."""
    monkeypatch.setenv(loopback.SERVER_PORTS_ENV, "21100-21109")
    monkeypatch.setattr(loopback, "_handed_out", set())
    loopback.reserve_ports(21100, 21105)
    ports = {loopback.free_port() for _ in range(8)}
    assert ports == set(range(21100, 21110)) - {21100, 21105}
