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
        assert port in local_cluster.SERVER_PORTS and not low <= port <= high
        assert local_cluster.port_is_free(port)
