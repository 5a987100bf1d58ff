"""A drafter replica over gRPC: `GrpcDrafter`, the router's `DrafterPort` (and `PredraftPort`)
over the network.

Its session calls (open, draft, predraft, close) are entries of the client's Frames stream,
with the timeouts, liveness, errors and deadlines of every replica client
(`cluster.routing.grpc_replica`). A drafter's q rows are kept as received
(`cluster.wire.distributions.WireRows`) and sent on to the verifier as bytes: the router never
decodes q.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.routing.grpc_replica import ReplicaClient
from cluster.routing.waits import Waits
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.predraft import Branch, PreDraft
from cluster.wire import requests
from cluster.wire.blocks import block_from_wire, predrafts_from_wire
from protos import replica_pb2_grpc


class GrpcDrafter(ReplicaClient):
    """A drafter replica over gRPC; a `DrafterPort`."""

    _kind = "drafter"
    _service = "tandem.v1.Drafter"
    _stub_class = replica_pb2_grpc.DrafterStub

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Waits[DraftBlock]:
        """See `DrafterPort.draft`; yields its waits. The block's q stays as received
        (`cluster.wire.distributions.WireRows`)."""
        request = requests.draft_request_to_wire(
            session_id, base_length, appended_tokens, num_tokens, truncate_to
        )
        block = yield from self._send("draft", request, timeout_s)
        return block_from_wire(block, lazy_rows=True)

    def predraft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        block: Sequence[int],
        branches: Sequence[Branch],
        num_tokens: int,
        truncate_to: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Waits[list[PreDraft]]:
        """See `DrafterPort.predraft`; yields its waits. Each branch's q stays as received
        (`cluster.wire.distributions.WireRows`)."""
        request = requests.predraft_request_to_wire(
            session_id, base_length, appended_tokens, block, branches, num_tokens, truncate_to
        )
        response = yield from self._send("predraft", request, timeout_s)
        return predrafts_from_wire(response, lazy_rows=True)
