"""What a replica tells the cluster's registry about itself, once per heartbeat.

`ReplicaInfo` is the heartbeat: where a replica serves (address, Ray node, resources) and how
loaded it is (sessions, busy share, queue, KV bytes, its engine's figures). The replica host
(`cluster.replica.host`) builds one per heartbeat; the registry (`cluster.routing.registry`)
keeps them, the directory (`cluster.routing.directory`) pins requests by them, and the metrics
export them. It travels through Ray as a plain dict (`to_dict`, `from_dict`), read leniently so
replicas and routers of different versions understand each other during a rolling upgrade.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.runtime.engine_stats import EngineStats

REGISTRY_NAMESPACE = "tandem"
"""Ray namespace of the replica registry actor."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica reports about itself in each heartbeat. Every number is a gauge of now
    (exported as such by the registry's metrics)."""

    replica_id: str
    side: str
    """`drafter`, `verifier` or `suffix` (a suffix drafter: `drafter.suffix`)."""
    address: str
    """host:port of its internal gRPC server."""
    num_sessions: int
    num_cached_tokens: int
    pid: int = 0
    """The replica's process id on its node (what `tandem loadtest --kill` signals)."""
    busy_fraction: float = 0.0
    """Share of the last heartbeat interval its component spent serving calls (0..1)."""
    queue_depth: int = 0
    """Calls waiting for the component when last sampled: with an engine, the calls waiting
    for its next step (`EngineStats.queued`; the ones in a step are served, however many);
    without, the calls inside the server's handlers less the one being served."""
    kv_bytes: int = 0
    """Bytes held by its sessions' KV caches: cached tokens times the model's KV bytes per
    token (0 when the model's config does not say how many; see `kv_cache_bytes_per_token`)."""
    index_bytes: int | None = None
    """A suffix drafter's indexes: bytes held, proposals asked and those that proposed
    (`ReplicaStats`); None on other replicas, so they export no such gauge."""
    index_proposals: int | None = None
    index_proposed: int | None = None
    engine: dict[str, Any] | None = None
    """Its batching engine's figures (`EngineStats.to_dict()`); None where no engine runs. A
    dict, not an `EngineStats`, so it travels as plain data and keeps the figures of a newer
    engine that this version does not know."""
    node_id: str = ""
    """The Ray node it runs on (hex id); empty outside Ray, and from an older replica."""
    resources: dict[str, float] = field(default_factory=dict)
    """The Ray resources its process holds: its group's `ray_actor_options` as Ray granted
    them (custom resources such as `tandem_drafter_node`, CPU, GPU, `accelerator_type:<GPU>`;
    none asked, none held); empty outside Ray."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaInfo:
        # Fields this version does not know are dropped, and ones it lacks take their default:
        # during a rolling upgrade, newer replicas heartbeat to an older registry and older
        # routers, and older replicas (no `engine`) to newer ones.
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        if not isinstance(fields.get("engine"), dict):
            fields["engine"] = None
        if not isinstance(fields.get("node_id", ""), str):
            fields["node_id"] = ""
        if not isinstance(fields.get("resources", {}), dict):
            fields["resources"] = {}
        return cls(**fields)

    def engine_stats(self) -> EngineStats | None:
        """The engine's figures as `EngineStats` (those this version knows); None if none."""
        return None if self.engine is None else EngineStats.from_dict(self.engine)

    @property
    def kv_used(self) -> float:
        """Share of the engine's KV pool in use (0..1); 0 with no engine or no pool."""
        engine = self.engine_stats()
        if engine is None or engine.kv_blocks_total <= 0:
            return 0.0
        return min(1.0, max(0.0, engine.kv_blocks_used / engine.kv_blocks_total))

    def autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets from this replica (names as `cluster.serve.autoscaling`
        reads them)."""
        engine = self.engine_stats()
        return {
            "sessions": float(self.num_sessions),
            "busy": self.busy_fraction,
            "queue": float(self.queue_depth),
            "kv_used": self.kv_used,
            "queue_wait_s": 0.0 if engine is None else float(engine.queue_wait_s),
        }
