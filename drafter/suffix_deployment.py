"""The suffix drafter replica as a Serve deployment body (the app builder applies
`serve.deployment`, asking for CPUs only: `cluster.serve.app`).

A thin shell with no model to load: it hosts a `SuffixDrafter` behind its `SuffixServicer` on
its own gRPC port and heartbeats to the registry as side `suffix` (`ReplicaShell`), so routers
pin one beside each request's model drafter. Its heartbeat carries the indexes' size and how
often they proposed, which the registry exports as the replica gauges
`tandem_replica_index_bytes`, `..._index_proposals` and `..._index_proposed`.
"""

from __future__ import annotations

from cluster.replica.host import ReplicaShell
from drafter.config import SuffixConfig
from drafter.suffix import SuffixDrafter
from drafter.suffix_servicer import SuffixServicer

SIDE = "suffix"
"""The registry's name for suffix drafter replicas."""


class SuffixReplica(ReplicaShell):
    def __init__(
        self,
        config: SuffixConfig,
        registry_name: str | None,
        secret: str,
        bind_host: str | None = None,
    ) -> None:
        """`secret`: the cluster's shared secret; the replica serves only calls carrying it."""
        self.component = SuffixDrafter(config)
        servicer = SuffixServicer(self.component)
        self._serve(
            SIDE,
            servicer.add_to_server,
            self.component.stats,
            registry_name,
            bind_host,
            secret,
            self.component.evict_idle,
            alive=lambda: self.component.alive,
        )
