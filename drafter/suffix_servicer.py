"""The suffix drafter's gRPC servicer: `tandem.v1.Drafter` over a plain `SuffixDrafter`.

The same service and messages as a model drafter (`drafter.servicer`), so the router reaches a
suffix replica with the same client (`GrpcDrafter`), unary or over its Frames stream. What
differs: OpenSession reads the request's `tenant` (whose index the session drafts from), every
call is answered on the thread that reads it (there is no engine: a Frames stream answers a
frame's entries together, as soon as it has read them), and Predraft is refused
(INVALID_ARGUMENT): a suffix proposal has no outcomes to branch on, and the router stops asking.
"""

from __future__ import annotations

from concurrent.futures import Future

import grpc

from cluster.replica.frames import EntryHandler
from cluster.replica.servicer import SessionServicer
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import InvalidArgumentError
from cluster.wire import requests
from drafter.servicer import drafted
from drafter.suffix import SuffixDrafter, answered
from protos import replica_pb2, replica_pb2_grpc

NO_PREDRAFT = "the suffix drafter does not pre-draft"


class SuffixServicer(SessionServicer[SuffixDrafter], replica_pb2_grpc.DrafterServicer):
    """Serves one `SuffixDrafter` over gRPC."""

    def __init__(self, drafter: SuffixDrafter) -> None:
        super().__init__(drafter, "SuffixDrafter")

    def add_to_server(self, server: grpc.Server) -> None:
        replica_pb2_grpc.add_DrafterServicer_to_server(self, server)

    def _entry_handlers(self) -> dict[str, EntryHandler]:
        return {
            **super()._entry_handlers(),
            "draft": EntryHandler(self._submit_draft, drafted),
            "predraft": EntryHandler(_refuse_predraft, drafted),
        }

    def _submit_open(self, request: replica_pb2.OpenSessionRequest) -> Future[int]:
        def call() -> int:
            read = requests.open_request_from_wire(request)
            return self.component.open_session(
                read.session_id,
                read.prompt_tokens,
                read.sampling,
                read.seed,
                time_limit_s=read.time_limit_s,
                max_new_tokens=read.max_new_tokens,
                resumed=read.resumed,
                constraint=read.constraint,
                tenant=read.tenant,
            )

        return answered(call)

    def _submit_draft(self, request: replica_pb2.DraftRequest) -> Future[DraftBlock]:
        def call() -> DraftBlock:
            read = requests.draft_request_from_wire(request)
            return self.component.draft(
                read.session_id,
                read.base_length,
                read.appended_tokens,
                read.num_tokens,
                truncate_to=read.truncate_to,
            )

        return answered(call)


def _refuse_predraft(request: replica_pb2.PredraftRequest) -> Future[DraftBlock]:
    return answered(_raise_no_predraft)


def _raise_no_predraft() -> DraftBlock:
    raise InvalidArgumentError(NO_PREDRAFT)
