"""The replica registry: where every drafter and verifier replica is, and how loaded.

`ReplicaRegistry` is plain Python (a clock is injected, so tests need no Ray): replicas send
heartbeats carrying a `ReplicaInfo` dict, and an entry whose heartbeats stop for `ttl_s` is
forgotten. It runs as one named, detached Ray actor per application (`ensure_registry`), which
Ray restarts if it dies; heartbeats refill it within a second, since replicas hold the truth
and the registry only soft state.

Each heartbeat's measurements become the replica's gauges (`cluster.metrics`:
`tandem_replica_<field>{replica_id, side}`, and `tandem_replica_engine_<figure>` for its
engine's); a replica that leaves or goes silent has its gauges dropped.

Why a registry and not Serve's routing: blocks go straight to the replica that holds a
session's KV cache, over gRPC, with no Serve hop; the router needs the replicas' addresses to
pin sessions, and Serve does not list a deployment's replicas to user code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cluster.metrics.recorder import TandemMetrics
from cluster.wire.replica_info import REGISTRY_NAMESPACE, ReplicaInfo

DEFAULT_TTL_S = 5.0
HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node alone (1 of it)."""
HEAD_NODE_SHARE = 0.001


def registry_name(app_name: str) -> str:
    return f"tandem-registry-{app_name}"


class ReplicaRegistry:
    """Replica entries by id, each with the time of its last heartbeat."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        metrics: TandemMetrics | None = None,
    ):
        """`metrics`: where the replicas' gauges go (default: Ray's metrics, in the actor)."""
        self._ttl_s = ttl_s
        self._clock = clock
        self._metrics = metrics if metrics is not None else TandemMetrics()
        self._entries: dict[str, tuple[ReplicaInfo, float]] = {}

    def heartbeat(self, info: dict[str, Any]) -> None:
        entry = ReplicaInfo.from_dict(info)
        self._entries[entry.replica_id] = (entry, self._clock())
        self._metrics.replica_seen(entry.to_dict())
        self._expire()

    def remove(self, replica_id: str) -> bool:
        removed = self._entries.pop(replica_id, None)
        if removed is not None:
            self._metrics.replica_gone(removed[0].to_dict())
        return removed is not None

    def replicas(self, side: str | None = None) -> list[dict[str, Any]]:
        """Live entries (as dicts), optionally of one side, oldest id first."""
        self._expire()
        return [
            info.to_dict()
            for info, _ in sorted(self._entries.values(), key=lambda e: e[0].replica_id)
            if side is None or info.side == side
        ]

    def _expire(self) -> None:
        """Forget the replicas silent for longer than the TTL."""
        now = self._clock()
        for replica_id in [r for r, (_, seen) in self._entries.items() if now - seen > self._ttl_s]:
            self.remove(replica_id)


def ensure_registry(app_name: str) -> Any:
    """The application's registry actor, created if it does not exist yet, on the head node.
    Ray would otherwise put it on any node, a drafter's say, and losing that node would leave
    routers without a registry until Ray restarted it elsewhere: new requests would fail
    meanwhile. Asking for a sliver of the head's own resource keeps it on whichever node is the
    head, a restarted head included."""
    import ray

    actor_class = ray.remote(ReplicaRegistry)
    return actor_class.options(
        name=registry_name(app_name),
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
        resources={HEAD_NODE_RESOURCE: HEAD_NODE_SHARE},
    ).remote()


def get_registry(app_name: str) -> Any:
    """The application's registry actor; raises ValueError if there is none."""
    import ray

    return ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE)
