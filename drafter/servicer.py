"""The drafter's gRPC servicer: `tandem.v1.Drafter` over a plain `Drafter`.

A thin adapter: the session RPCs come from `SessionServicer` (cluster/replica/servicer.py); the
one of its own, Draft, converts the request with `cluster.wire.convert`, calls the drafter
under the servicer's `CallGuard` (errors become gRPC statuses; calls run concurrently, batched
by the drafter's engine), and converts the block back.

Chaos for soak tests: given an `error_fraction` above 0 (`DrafterConfig.error_fraction`), that
share of Draft calls, drawn from the servicer's own `random.Random`, is answered INTERNAL
(`InjectedError`) before the drafter sees it, as a faulty drafter would answer.
"""

from __future__ import annotations

import random

import grpc

from cluster.replica.servicer import SessionServicer
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.wire import convert
from drafter.drafter import Drafter
from protos import replica_pb2, replica_pb2_grpc


class InjectedError(TandemError):
    """A Draft call failed on purpose (`error_fraction`): INTERNAL, as a drafter's own fault."""

    status = "INTERNAL"


class DrafterServicer(SessionServicer[Drafter], replica_pb2_grpc.DrafterServicer):
    """Serves one `Drafter` over gRPC."""

    def __init__(
        self, drafter: Drafter, error_fraction: float = 0.0, chaos: random.Random | None = None
    ) -> None:
        """`error_fraction`: share of Draft calls answered INTERNAL on purpose (0: none), drawn
        from `chaos` (default: a generator seeded from the OS)."""
        super().__init__(drafter, "Drafter")
        if not 0.0 <= error_fraction <= 1.0:
            raise InvalidArgumentError(f"error_fraction must be in [0, 1], got {error_fraction}")
        self._error_fraction = error_fraction
        self._chaos = chaos if chaos is not None else random.Random()

    def add_to_server(self, server: grpc.Server) -> None:
        replica_pb2_grpc.add_DrafterServicer_to_server(self, server)

    def Draft(
        self, request: replica_pb2.DraftRequest, context: grpc.ServicerContext
    ) -> replica_pb2.DraftBlock:
        def call() -> replica_pb2.DraftBlock:
            if self._error_fraction and self._chaos.random() < self._error_fraction:
                raise InjectedError("Draft failed on purpose (drafter_limits.error_fraction)")
            block = self.component.draft(
                convert.session_id_from_wire(request.session_id),
                request.base_length,
                tuple(request.appended_token_ids),
                request.num_tokens,
                truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
            )
            return convert.block_to_wire(block)

        return self._guard.run(context, "Draft", call)
