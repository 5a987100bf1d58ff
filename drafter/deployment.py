"""The drafter replica as a Serve deployment body (the app builder applies `serve.deployment`).

The shared body (`verifier.replica.deployment.ComponentReplica`) loads the draft model and
hosts a `Drafter` behind its `DrafterServicer`.
"""

from __future__ import annotations

from drafter.drafter import Drafter, DrafterConfig
from drafter.servicer import DrafterServicer
from verifier.replica.deployment import ComponentReplica
from verifier.runtime.models import LoadedModel


class DrafterReplica(ComponentReplica[DrafterConfig]):
    side = "drafter"

    def _servicer(self, model: LoadedModel, config: DrafterConfig) -> DrafterServicer:
        return DrafterServicer(Drafter(model, config))
