"""The drafter's gRPC servicer: `tandem.v1.Drafter` over a plain `Drafter`.

A thin adapter: the session RPCs come from `SessionServicer` (cluster/replica/servicer.py); the
one of its own, Draft, converts the request with `cluster.replica.wire`, calls the drafter
under the servicer's `CallGuard` (errors become gRPC statuses; calls run concurrently, batched
by the drafter's engine), and converts the block back.
"""

from __future__ import annotations

import grpc

from cluster.replica import wire
from cluster.replica.servicer import SessionServicer
from drafter.drafter import Drafter
from protos import replica_pb2, replica_pb2_grpc


class DrafterServicer(SessionServicer[Drafter], replica_pb2_grpc.DrafterServicer):
    """Serves one `Drafter` over gRPC."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__(drafter, "Drafter")

    def add_to_server(self, server: grpc.Server) -> None:
        replica_pb2_grpc.add_DrafterServicer_to_server(self, server)

    def Draft(
        self, request: replica_pb2.DraftRequest, context: grpc.ServicerContext
    ) -> replica_pb2.DraftBlock:
        def call() -> replica_pb2.DraftBlock:
            block = self.component.draft(
                wire.session_id_from_wire(request.session_id),
                request.base_length,
                tuple(request.appended_token_ids),
                request.num_tokens,
                truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
            )
            return wire.block_to_wire(block)

        return self._guard.run(context, "Draft", call)
