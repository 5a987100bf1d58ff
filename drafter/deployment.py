"""The drafter replica as a Serve deployment body (the app builder applies `serve.deployment`).

The shared body (`cluster.replica.deployment.ComponentReplica`) loads the draft model and
hosts a `Drafter` behind its `DrafterServicer`.
"""

from __future__ import annotations

from cluster.replica.deployment import ComponentReplica
from cluster.runtime.models import LoadedModel
from drafter.drafter import Drafter, DrafterConfig
from drafter.servicer import DrafterServicer


class DrafterReplica(ComponentReplica[DrafterConfig]):
    side = "drafter"

    def _servicer(self, model: LoadedModel, config: DrafterConfig) -> DrafterServicer:
        return DrafterServicer(Drafter(model, config))
