"""The service's state file as the measuring tools read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.serve import ray_cluster


def test_replica_addresses_without_a_service_says_how_to_start_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    with pytest.raises(ray_cluster.ClusterError, match="start one with tandem serve"):
        ray_cluster.replica_addresses()
