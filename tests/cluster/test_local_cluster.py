"""The local service's state file as the measuring tools read it."""

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
