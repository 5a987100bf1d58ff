"""The drafter replica as a Serve deployment body (the app builder applies `serve.deployment`).

A thin shell: load the draft model, build the `Drafter`, serve it over gRPC on its own port and
heartbeat to the registry. Serve places it, restarts it, checks its health, scales it on
the load it reports (`record_autoscaling_stats`) and, when it stops it, lets it drain.
"""

from __future__ import annotations

from collections.abc import Sequence

from drafter.drafter import Drafter, DrafterConfig
from drafter.servicer import DrafterServicer
from protos import replica_pb2_grpc
from verifier.replica.host import ReplicaShell, kv_cache_bytes_per_token, place_threads
from verifier.runtime.models import ModelSpec, load_model


class DrafterReplica(ReplicaShell):
    def __init__(
        self,
        model: ModelSpec,
        config: DrafterConfig,
        registry_name: str | None,
        secret: str,
        torch_threads: int = 0,
        bind_host: str | None = None,
        cpus: Sequence[int] = (),
    ) -> None:
        """`secret`: the cluster's shared secret; the replica serves only calls carrying it."""
        place_threads(torch_threads, cpus)
        loaded = load_model(model)
        self.drafter = Drafter(loaded, config)
        servicer = DrafterServicer(self.drafter)
        self._serve(
            "drafter",
            lambda server: replica_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
            self.drafter.stats,
            registry_name,
            bind_host,
            secret,
            self.drafter.evict_idle,
            kv_cache_bytes_per_token(loaded.model),
        )
