"""Pinning requests to replicas found in the registry: the distributed `ReplicaPool`.

For each new request the router asks for one verifier and (when speculating) one drafter, and
one suffix drafter where any runs: the one that holds the tenant's index (the same for all of a
tenant's requests, on every router: rendezvous hashing over the live suffix replicas). We
pick the least-loaded live replica of each side: load is the larger of the sessions the replica
last reported and the requests this router has pinned to it and not yet released (the report
is up to a heartbeat old; our own count is exact for our share). Ties are broken at random, so
sessions spread over equal replicas. The registry is read at most every `refresh_s` seconds.
Clients (gRPC channels) are kept per address and reused by every request pinned there; each
request gets views of them bound to its deadline (`GrpcVerifier.bounded`), which stop its calls
when its time runs out and tell the replicas how long its sessions may live.

A request with no drafter available runs on the target alone (lossless, just slower); with no
verifier it fails with UNAVAILABLE. When a pinned replica fails a call, the router asks for a
spare of the same side, never one that already failed that request.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.ports import Pinned, Spare, StepCosts
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.wire.replica_info import ReplicaInfo

SUFFIX_SIDE = "suffix"
"""The registry's side of suffix drafter replicas (`drafter.suffix_deployment`)."""
DEFAULT_REFRESH_S = 0.5
REGISTRY_TIMEOUT_S = 10.0

FetchReplicas = Callable[[], list[dict[str, Any]]]
"""Returns the registry's live entries (`ReplicaInfo` dicts)."""


def from_registry_actor(registry: Any) -> FetchReplicas:
    """Read the entries of a registry actor (see `cluster.routing.registry`)."""

    def fetch() -> list[dict[str, Any]]:
        import ray

        return list(ray.get(registry.replicas.remote(), timeout=REGISTRY_TIMEOUT_S))

    return fetch


class RegistryPool:
    """Chooses replicas for requests from the registry actor's live entries."""

    waits_without_threads = True
    """Its clients answer on Frames streams: their steps wait without a thread."""

    def __init__(
        self,
        fetch: FetchReplicas,
        refresh_s: float = DEFAULT_REFRESH_S,
        rpc_timeout_s: float | None = None,
        secret: str | None = None,
    ) -> None:
        """`secret`: the cluster's shared secret, sent with every call to a replica."""
        self._fetch = fetch
        self._secret = secret
        self._refresh_s = refresh_s
        self._rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._entries: list[ReplicaInfo] = []
        self._fetched_at = -float("inf")
        self._pinned: Counter[str] = Counter()
        self._drafters: dict[str, GrpcDrafter] = {}
        self._verifiers: dict[str, GrpcVerifier] = {}
        self._suffixes: dict[str, GrpcDrafter] = {}
        """Suffix drafters serve the drafter's service: the same client."""
        self._random = random.Random()

    def replicas(self) -> list[ReplicaInfo]:
        """Live replicas as of the last registry read (refreshing it when stale)."""
        self._refresh()
        return list(self._entries)

    def pin(
        self,
        speculate: bool,
        deadline: float | None = None,
        tenant: str = "",
        suffix: bool = True,
    ) -> Pinned:
        """The least-loaded live verifier (and drafter, if `speculate`, and `tenant`'s suffix
        drafter, if `suffix` too), pinned, as clients bound to `deadline`; raises
        `ReplicaUnavailableError` when no verifier is live."""
        self._refresh()
        with self._lock:
            verifier = self._least_loaded("verifier")
            if verifier is None:
                raise ReplicaUnavailableError("no verifier replica is available")
            drafter = self._least_loaded("drafter") if speculate else None
            home = self._tenants_suffix(tenant) if speculate and suffix else None
            chosen = [info for info in (verifier, drafter, home) if info is not None]
            for info in chosen:
                self._pinned[info.replica_id] += 1
            verifier_port = self._client(self._verifiers, GrpcVerifier, verifier.address)
            drafter_port = (
                None
                if drafter is None
                else self._client(self._drafters, GrpcDrafter, drafter.address).bounded(deadline)
            )
            verifier_port = verifier_port.bounded(deadline)
            suffix_port = (
                None
                if home is None
                else self._client(self._suffixes, GrpcDrafter, home.address).bounded(deadline)
            )

        def release() -> None:
            with self._lock:
                for info in chosen:
                    self._pinned[info.replica_id] -= 1
                    if self._pinned[info.replica_id] <= 0:
                        del self._pinned[info.replica_id]

        return Pinned(
            verifier_port,
            drafter_port,
            release,
            verifier_id=verifier.replica_id,
            drafter_id=drafter.replica_id if drafter is not None else "",
            suffix=suffix_port,
            suffix_id=home.replica_id if home is not None else "",
            step_costs=step_costs(verifier, drafter),
        )

    def spare(
        self, side: str, avoid: frozenset[str], deadline: float | None = None
    ) -> Spare | None:
        """The least-loaded live replica of `side` not in `avoid`, pinned, as a client bound to
        `deadline`; None if none."""
        self._refresh()
        with self._lock:
            chosen = self._least_loaded(side, avoid)
            if chosen is None:
                return None
            self._pinned[chosen.replica_id] += 1
            kind, cache = (
                (GrpcVerifier, self._verifiers)
                if side == "verifier"
                else (GrpcDrafter, self._drafters)
            )
            port = self._client(cache, kind, chosen.address).bounded(deadline)

        def release() -> None:
            with self._lock:
                self._pinned[chosen.replica_id] -= 1
                if self._pinned[chosen.replica_id] <= 0:
                    del self._pinned[chosen.replica_id]

        return Spare(port, chosen.replica_id, release)

    def pinned_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pinned)

    def close(self) -> None:
        with self._lock:
            clients = [*self._drafters.values(), *self._verifiers.values()]
            for client in [*clients, *self._suffixes.values()]:
                client.close()
            self._drafters.clear()
            self._verifiers.clear()
            self._suffixes.clear()

    def _refresh(self) -> None:
        if time.monotonic() - self._fetched_at < self._refresh_s:
            return
        entries = self._fetch()
        with self._lock:
            self._entries = [ReplicaInfo.from_dict(e) for e in entries]
            self._fetched_at = time.monotonic()

    def _tenants_suffix(self, tenant: str) -> ReplicaInfo | None:
        """The suffix drafter that holds `tenant`'s index: the live one ranked first for the
        tenant by rendezvous hashing, so every router sends a tenant's requests to the same
        replica, and a replica joining or leaving moves only the tenants it ranks first."""
        candidates = [e for e in self._entries if e.side == SUFFIX_SIDE]
        if not candidates:
            return None
        return max(candidates, key=lambda e: _rank(tenant, e.replica_id))

    def _least_loaded(self, side: str, avoid: frozenset[str] = frozenset()) -> ReplicaInfo | None:
        candidates = [e for e in self._entries if e.side == side and e.replica_id not in avoid]
        if not candidates:
            return None
        loads = {e.replica_id: max(e.num_sessions, self._pinned[e.replica_id]) for e in candidates}
        lightest = min(loads.values())
        return self._random.choice([e for e in candidates if loads[e.replica_id] == lightest])

    def _client(self, cache: dict[str, Any], kind: type, address: str) -> Any:
        if address not in cache:
            cache[address] = kind(address, timeout_s=self._rpc_timeout_s, secret=self._secret)
        return cache[address]


def step_costs(verifier: ReplicaInfo, drafter: ReplicaInfo | None) -> StepCosts | None:
    """The two replicas' start-up step cost curves, from their heartbeats; None where a side
    has none to give (no drafter, no engine, not measured)."""
    if drafter is None:
        return None
    verifier_engine, drafter_engine = verifier.engine_stats(), drafter.engine_stats()
    if verifier_engine is None or drafter_engine is None:
        return None
    if verifier_engine.startup_step_s <= 0 or drafter_engine.startup_step_s <= 0:
        return None
    return StepCosts(
        draft_base_s=drafter_engine.startup_base_s,
        draft_per_token_s=drafter_engine.startup_per_token_s,
        verify_base_s=verifier_engine.startup_base_s,
        verify_per_token_s=verifier_engine.startup_per_token_s,
        shared_cores=share_cores(verifier, drafter),
    )


def share_cores(verifier: ReplicaInfo, drafter: ReplicaInfo) -> bool:
    """Whether the two replicas' forward passes take the same CPU cores: both on one node
    (both outside Ray: one machine), neither on a simulated device, neither holding a GPU.
    Replicas pinned to disjoint CPUs (`drafter_cpus`, `verifier_cpus`) count as sharing: a
    replica does not report its CPUs, and lockstep rounds cost them little (`Router`)."""
    engines = (verifier.engine_stats(), drafter.engine_stats())
    if any(engine is None or engine.runner == "sim" for engine in engines):
        return False
    if any(replica.resources.get("GPU", 0.0) > 0 for replica in (verifier, drafter)):
        return False
    return verifier.node_id == drafter.node_id


def _rank(tenant: str, replica_id: str) -> bytes:
    """`replica_id`'s rank for `tenant` (rendezvous hashing): the same on every router."""
    return hashlib.blake2b(f"{tenant}\0{replica_id}".encode(), digest_size=8).digest()
