"""The drafter's gRPC servicer: `tandem.v1.Drafter` over a plain `Drafter`.

A thin adapter: Stats and the Frames stream come from `SessionServicer`
(cluster/replica/servicer.py); its own entries, draft and predraft (outcome-keyed
pre-drafting), convert the request with `cluster.wire.requests`, submit it to the drafter
(`submit_draft`, `submit_predraft`: calls run concurrently, batched by the drafter's engine),
and convert the block or branches back.

Chaos for soak tests: given an `error_fraction` above 0 (`DrafterConfig.error_fraction`), that
share of draft and predraft entries, drawn from the servicer's own
`random.Random`, is answered INTERNAL (`InjectedError`) before the drafter sees it, as a faulty
drafter would.
"""

from __future__ import annotations

import random
from concurrent.futures import Future

import grpc

from cluster.replica.frames import EntryHandler
from cluster.replica.servicer import SessionServicer
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.runtime.predraft import PreDraft
from cluster.wire import requests
from cluster.wire.blocks import block_to_wire, predrafts_to_wire
from drafter.drafter import Drafter
from protos import replica_pb2, replica_pb2_grpc


class InjectedError(TandemError):
    """A Draft or Predraft call failed on purpose (`error_fraction`): INTERNAL, as a drafter's
    own fault."""

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

    def _maybe_fail(self, call: str = "Draft") -> None:
        """Fail this draft on purpose, `error_fraction` of the time."""
        if self._error_fraction and self._chaos.random() < self._error_fraction:
            raise InjectedError(f"{call} failed on purpose (drafter_limits.error_fraction)")

    def _entry_handlers(self) -> dict[str, EntryHandler]:
        return {
            **super()._entry_handlers(),
            "draft": EntryHandler(self._submit_draft, drafted),
            "predraft": EntryHandler(self._submit_predraft, _predrafted),
        }

    def _submit_draft(self, request: replica_pb2.DraftRequest) -> Future[DraftBlock]:
        self._maybe_fail()
        read = requests.draft_request_from_wire(request)
        return self.component.submit_draft(
            read.session_id,
            read.base_length,
            read.appended_tokens,
            read.num_tokens,
            truncate_to=read.truncate_to,
        )

    def _submit_predraft(self, request: replica_pb2.PredraftRequest) -> Future[list[PreDraft]]:
        self._maybe_fail("Predraft")
        read = requests.predraft_request_from_wire(request)
        return self.component.submit_predraft(
            read.session_id,
            read.base_length,
            read.appended_tokens,
            read.block,
            read.branches,
            read.num_tokens,
            truncate_to=read.truncate_to,
        )


def drafted(block: DraftBlock) -> replica_pb2.FrameResult:
    return replica_pb2.FrameResult(block=block_to_wire(block))


def _predrafted(branches: list[PreDraft]) -> replica_pb2.FrameResult:
    return replica_pb2.FrameResult(predrafted=predrafts_to_wire(branches))
