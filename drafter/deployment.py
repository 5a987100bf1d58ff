"""The drafter replica as a Serve deployment body (the app builder applies `serve.deployment`).

The shared body (`cluster.replica.deployment.ComponentReplica`) loads the draft model and
hosts a `Drafter` behind its `DrafterServicer`. Only the replica Serve ranks `CHAOS_RANK`
answers Draft calls with errors on purpose (`DrafterConfig.error_fraction`, for soak tests), so
its siblings keep the healthy path beside it.
"""

from __future__ import annotations

from cluster.replica.deployment import ComponentReplica
from cluster.replica.placement import serve_rank
from cluster.runtime.models import LoadedModel
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from drafter.servicer import DrafterServicer

CHAOS_RANK = 0
"""The drafter replica that honours `error_fraction`."""


class DrafterReplica(ComponentReplica[DrafterConfig]):
    side = "drafter"

    def _servicer(self, model: LoadedModel, config: DrafterConfig) -> DrafterServicer:
        error_fraction = config.error_fraction if serve_rank() == CHAOS_RANK else 0.0
        return DrafterServicer(Drafter(model, config), error_fraction)
