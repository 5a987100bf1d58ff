"""The verifier replica as a Serve deployment body (the app builder applies `serve.deployment`).

A thin shell: load the target, build the `Verifier`, serve it over gRPC on its own port and
heartbeat to the registry. Serve only places it, restarts it and checks its health.
"""

from __future__ import annotations

from protos import replica_pb2_grpc
from verifier.models import ModelSpec, load_model
from verifier.replica_host import ReplicaShell, set_torch_threads
from verifier.servicer import VerifierServicer
from verifier.verifier import Verifier, VerifierConfig


class VerifierReplica(ReplicaShell):
    def __init__(
        self,
        model: ModelSpec,
        config: VerifierConfig,
        registry_name: str | None,
        torch_threads: int = 0,
        bind_host: str | None = None,
    ) -> None:
        set_torch_threads(torch_threads)
        self.verifier = Verifier(load_model(model), config)
        servicer = VerifierServicer(self.verifier)
        self._serve(
            "verifier",
            lambda server: replica_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
            self.verifier.stats,
            registry_name,
            bind_host,
        )
