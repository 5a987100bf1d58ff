"""The verifier replica as a Serve deployment body (the app builder applies `serve.deployment`).

The shared body (`cluster.replica.deployment.ComponentReplica`) loads the target and hosts a
`Verifier` behind its `VerifierServicer`.
"""

from __future__ import annotations

from cluster.replica.deployment import ComponentReplica
from cluster.runtime.models import LoadedModel
from verifier.config import VerifierConfig
from verifier.servicer import VerifierServicer
from verifier.verifier import Verifier


class VerifierReplica(ComponentReplica[VerifierConfig]):
    side = "verifier"

    def _servicer(self, model: LoadedModel, config: VerifierConfig) -> VerifierServicer:
        return VerifierServicer(Verifier(model, config))
