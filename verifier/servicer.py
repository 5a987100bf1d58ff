"""The verifier's gRPC servicer: `tandem.v1.Verifier` over a plain `Verifier`.

A thin adapter: Stats and the Frames stream come from `SessionServicer`
(cluster/replica/servicer.py); its own entries: open (a session opened with `advance` runs,
and each of its own steps is reported under the entry's tag: `_submit_open_running`) and
verify (the block converted with `cluster.wire.requests`, submitted to the verifier, the
verdict converted back; calls run concurrently, batched by the verifier's engine). Reference
(the audit's replay) runs in the handler's own thread, between the engine's calls
(`verifier.audit_replica`); its gaps travel as raw float32 bytes
(`cluster.wire.distributions.floats_to_wire`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import grpc

from cluster.replica.frames import EntryHandler
from cluster.replica.servicer import SessionServicer, opened
from cluster.runtime.draft_block import Verdict
from cluster.wire import requests
from cluster.wire.blocks import verdict_to_wire
from cluster.wire.distributions import floats_to_wire
from cluster.wire.sampling_settings import sampling_from_wire
from protos import replica_pb2, replica_pb2_grpc
from verifier.verifier import Verifier


class VerifierServicer(SessionServicer[Verifier], replica_pb2_grpc.VerifierServicer):
    """Serves one `Verifier` over gRPC."""

    def __init__(self, verifier: Verifier) -> None:
        super().__init__(verifier, "Verifier")

    def add_to_server(self, server: grpc.Server) -> None:
        replica_pb2_grpc.add_VerifierServicer_to_server(self, server)

    def _entry_handlers(self) -> dict[str, EntryHandler]:
        return {
            **super()._entry_handlers(),
            "open": EntryHandler(self._submit_open_running, opened, reported=_verified),
            "verify": EntryHandler(self._submit_verify, _verified),
        }

    def _submit_open_running(
        self,
        request: replica_pb2.OpenSessionRequest,
        report: Callable[[Verdict | Exception], None],
    ) -> Future[int]:
        """An open entry; with `advance` set, the session runs and its own steps are reported
        under the entry's tag."""
        read = requests.open_request_from_wire(request)
        return self.component.submit_open(
            read.session_id,
            read.prompt_tokens,
            read.sampling,
            read.seed,
            time_limit_s=read.time_limit_s,
            max_new_tokens=read.max_new_tokens,
            resumed=read.resumed,
            constraint=read.constraint,
            advance=read.advance,
            sink=None if read.advance is None else report,
        )

    def _submit_verify(self, request: replica_pb2.VerifyRequest) -> Future[Verdict]:
        read = requests.verify_request_from_wire(request)
        return self.component.submit_verify(
            read.session_id, read.block, defer_bonus=read.defer_bonus
        )

    def Reference(
        self, request: replica_pb2.ReferenceRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReferenceResponse:
        def call() -> replica_pb2.ReferenceResponse:
            replay = self.component.reference(
                tuple(request.prompt_token_ids),
                tuple(request.served_token_ids),
                sampling_from_wire(request.sampling),
                request.seed,
                dtype=request.dtype,
            )
            return replica_pb2.ReferenceResponse(
                token_ids=replay.tokens,
                gaps=floats_to_wire(replay.gaps),
                served_gaps=floats_to_wire(replay.served_gaps),
                dtype=replay.dtype,
            )

        return self._guard.run(context, "Reference", call)


def _verified(verdict: Verdict) -> replica_pb2.FrameResult:
    return replica_pb2.FrameResult(verdict=verdict_to_wire(verdict))
