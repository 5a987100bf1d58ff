"""Registry expiry and least-loaded pinning, without Ray (clock and registry read injected)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from cluster.routing.directory import RegistryPool
from cluster.routing.registry import ReplicaRegistry
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.wire.replica_info import ReplicaInfo


def entry(replica_id: str, side: str, sessions: int = 0, port: int = 1) -> dict[str, Any]:
    return ReplicaInfo(replica_id, side, f"127.0.0.1:{port}", sessions, 0).to_dict()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_without_heartbeats() -> None:
    clock = Clock()
    registry = ReplicaRegistry(ttl_s=5.0, clock=clock)
    registry.heartbeat(entry("d1", "drafter"))
    registry.heartbeat(entry("v1", "verifier"))
    clock.now = 4.0
    registry.heartbeat(entry("v1", "verifier", sessions=3))
    assert [e["replica_id"] for e in registry.replicas()] == ["d1", "v1"]
    assert registry.replicas("verifier")[0]["num_sessions"] == 3
    clock.now = 6.0  # d1 silent for 6 s, v1 for 2 s
    assert [e["replica_id"] for e in registry.replicas()] == ["v1"]
    assert registry.remove("v1") and not registry.remove("v1")
    assert registry.replicas() == []


def pool(entries: list[dict[str, Any]]) -> RegistryPool:
    return RegistryPool(lambda: entries, refresh_s=0.0)


def test_sessions_spread_over_equal_replicas() -> None:
    entries = [entry("v1", "verifier", port=1), entry("v2", "verifier", port=2),
               entry("d1", "drafter", port=3), entry("d2", "drafter", port=4)]  # fmt: skip
    replicas = pool(entries)
    pins = [replicas.pin(speculate=True) for _ in range(8)]
    counts = Counter(replicas.pinned_counts())
    assert counts == {"v1": 4, "v2": 4, "d1": 4, "d2": 4}
    for pinned in pins:
        pinned.release()
    assert replicas.pinned_counts() == {}
    replicas.close()


def test_reported_load_steers_new_sessions() -> None:
    replicas = pool([entry("v1", "verifier", sessions=5, port=1), entry("v2", "verifier", port=2)])
    for _ in range(3):
        replicas.pin(speculate=False)
    assert replicas.pinned_counts() == {"v2": 3}


def test_no_drafter_means_target_only_and_no_verifier_is_unavailable() -> None:
    pinned = pool([entry("v1", "verifier")]).pin(speculate=True)
    assert pinned.drafter is None
    with pytest.raises(ReplicaUnavailableError, match="no verifier"):
        pool([entry("d1", "drafter")]).pin(speculate=True)


def test_a_spare_is_another_live_replica_of_the_side_never_one_that_failed() -> None:
    replicas = pool([entry("v1", "verifier", port=1), entry("v2", "verifier", sessions=9, port=2),
                     entry("d1", "drafter", port=3)])  # fmt: skip
    pinned = replicas.pin(speculate=True)
    assert (pinned.verifier_id, pinned.drafter_id) == ("v1", "d1")
    spare = replicas.spare("verifier", frozenset({"v1"}))
    assert spare is not None and spare.replica_id == "v2"  # busier, but the only other one
    assert replicas.pinned_counts() == {"v1": 1, "v2": 1, "d1": 1}
    assert replicas.spare("verifier", frozenset({"v1", "v2"})) is None
    assert replicas.spare("drafter", frozenset({"d1"})) is None
    spare.release()
    pinned.release()
    assert replicas.pinned_counts() == {}
    replicas.close()


def test_a_tenants_requests_all_go_to_one_suffix_drafter_and_tenants_spread() -> None:
    """Rendezvous hashing: the same suffix replica for every request of a tenant whatever the
    load, tenants spread over the replicas, and a replica leaving moves only its tenants."""
    suffixes = [entry(f"s{i}", "suffix", sessions=i, port=10 + i) for i in range(3)]
    replicas = pool([entry("v1", "verifier"), entry("d1", "drafter", port=2), *suffixes])
    tenants = [f"tenant-{i}" for i in range(30)]
    homes = {}
    for tenant in tenants:
        pins = [replicas.pin(speculate=True, tenant=tenant) for _ in range(3)]
        assert len({pinned.suffix_id for pinned in pins}) == 1
        assert all(pinned.suffix is not None for pinned in pins)
        homes[tenant] = pins[0].suffix_id
        for pinned in pins:
            pinned.release()
    assert set(homes.values()) == {"s0", "s1", "s2"}
    assert replicas.pinned_counts() == {}
    assert replicas.pin(speculate=False, tenant=tenants[0]).suffix is None
    # A tenant that keeps its text out of the index pins no suffix replica (nor loads one).
    private = replicas.pin(speculate=True, tenant=tenants[0], suffix=False)
    assert private.suffix is None and private.suffix_id == ""
    assert set(replicas.pinned_counts()) == {"v1", "d1"}
    private.release()
    fewer = pool([entry("v1", "verifier"), *suffixes[:2]])
    for tenant, home in homes.items():
        moved = fewer.pin(speculate=True, tenant=tenant).suffix_id
        assert moved == home if home != "s2" else moved in {"s0", "s1"}
    replicas.close()
    fewer.close()
