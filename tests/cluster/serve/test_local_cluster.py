"""The local service's state file as the measuring tools read it, and the ports it picks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.serve import local_cluster


def test_replica_addresses_without_a_service_says_how_to_start_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(local_cluster.HOME_ENV, str(tmp_path))
    with pytest.raises(local_cluster.ClusterError, match="start one with tandem serve"):
        local_cluster.replica_addresses()


def test_free_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    """A server's port is picked where no outgoing connection can take it before the server
    binds it (the ephemeral range), and never twice in one process."""
    low, high = local_cluster._ephemeral_range()
    ports = [local_cluster.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port in local_cluster.server_ports() and not low <= port <= high
        assert local_cluster.port_is_free(port)


def test_free_ports_stay_in_the_range_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Processes given disjoint ranges (parallel test workers) never pick the same port."""
    monkeypatch.setenv(local_cluster.SERVER_PORTS_ENV, "21000-21099")
    ports = [local_cluster.free_port() for _ in range(20)]
    assert all(21000 <= port <= 21099 for port in ports)


@pytest.mark.parametrize("text", ["21000", "a-b", "19000-21000", "21000-40000", "22000-21000"])
def test_a_bad_port_range_is_refused_with_its_name(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(local_cluster.SERVER_PORTS_ENV, text)
    with pytest.raises(local_cluster.ClusterError, match=local_cluster.SERVER_PORTS_ENV):
        local_cluster.free_port()


def test_reserved_ports_are_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tandem serve --port P --http-port H` reserves P and H before Ray's servers get ports,
    so the cluster it starts cannot take them (a restart on the same ports once failed so)."""
    monkeypatch.setenv(local_cluster.SERVER_PORTS_ENV, "21100-21109")
    monkeypatch.setattr(local_cluster, "_handed_out", set())
    local_cluster.reserve_ports(21100, 21105)
    ports = {local_cluster.free_port() for _ in range(8)}
    assert ports == set(range(21100, 21110)) - {21100, 21105}
