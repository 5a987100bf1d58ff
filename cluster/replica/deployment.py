"""A drafter or verifier replica as a Serve deployment body (the app builder applies
`serve.deployment`).

A thin shell: load the model, build the side's component and its servicer, serve it over gRPC on
its own port and heartbeat to the registry (`ReplicaShell`). llguidance's view of the model's
tokenizer is built in the background from the start (`cluster.runtime.constraint.warm_up`), so
the first constrained request does not wait for it. Serve places it, restarts it,
checks its health, scales it on the load it reports (`record_autoscaling_stats`) and, when it
stops it, lets it drain. Each side's deployment module (`drafter.deployment.DrafterReplica`,
`verifier.deployment.VerifierReplica`) names only its side and how to build its servicer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

from cluster.replica.host import ReplicaShell
from cluster.replica.load import kv_cache_bytes_per_token
from cluster.replica.placement import place_threads
from cluster.replica.servicer import SessionServicer
from cluster.runtime.constraint import warm_up
from cluster.runtime.limits import SessionLimits
from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import LoadedModel, load_model

C = TypeVar("C", bound=SessionLimits)


class ComponentReplica(ReplicaShell, Generic[C]):
    """One replica of a side; a subclass sets `side` and builds the servicer (`_servicer`)."""

    side: ClassVar[str]
    """`drafter` or `verifier`: the registry's name for the side."""

    def __init__(
        self,
        model: ModelSpec,
        config: C,
        registry_name: str | None,
        secret: str,
        torch_threads: int = 0,
        bind_host: str | None = None,
        cpus: Sequence[int] = (),
    ) -> None:
        """`secret`: the cluster's shared secret; the replica serves only calls carrying it."""
        place_threads(torch_threads, cpus)
        loaded = load_model(model)
        servicer = self._servicer(loaded, config)
        self.component = servicer.component
        warm_up(self.component.grammar_tokenizer)
        self._serve(
            self.side,
            servicer.add_to_server,
            self.component.stats,
            registry_name,
            bind_host,
            secret,
            self.component.evict_idle,
            kv_cache_bytes_per_token(loaded.model),
            alive=lambda: self.component.alive,
        )

    def _servicer(self, model: LoadedModel, config: C) -> SessionServicer[Any]:
        """The side's servicer over a new component on `model`."""
        raise NotImplementedError
