"""The public `tandem.v1.Tandem` API over a `TandemService`: protobuf in, protobuf out.

`GrpcApi` is the gRPC face's thin adapter, shared by the Serve ingress
(`cluster.serve.ingress`), the test gRPC front (`tests.cluster.grpc_front`) and the CLI's
in-process mode: it authenticates the caller (once, first: UNAUTHENTICATED before any field is
read), reads the message into the service's domain types (`cluster.api.convert`), calls the
service, and writes what comes back as messages. The service itself never sees protobuf.

A stream is validated when it is opened (`stream` and `chunks` raise at once, before the first
chunk is asked for); closing it early closes the service's stream, which frees the request's
sessions on both replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import closing

from cluster.api.caller import ANONYMOUS_CALL, Caller
from cluster.api.convert import (
    audit_to_proto,
    chunk_to_proto,
    request_from_proto,
    response_to_proto,
    usage_to_proto,
)
from cluster.api.response import ApiChunk
from cluster.api.service import TandemService
from cluster.routing.waits import Wait, blocking
from protos import generate_pb2
from verifier.config import check_reference_dtype


class GrpcApi:
    """The `tandem.v1.Tandem` methods' messages over one `TandemService`."""

    def __init__(self, service: TandemService) -> None:
        self.service = service

    def generate(
        self,
        message: generate_pb2.GenerateRequest,
        is_active: Callable[[], bool] | None = None,
        caller: Caller = ANONYMOUS_CALL,
    ) -> generate_pb2.GenerateResponse:
        """Run a request to completion (`TandemService.generate`; `is_active` as there)."""
        tenant = self.service.authenticate(caller)
        request = request_from_proto(message)
        whole = self.service.generate(tenant, request, caller.deadline, is_active)
        return response_to_proto(whole)

    def chunk_waits(
        self, message: generate_pb2.GenerateRequest, caller: Caller = ANONYMOUS_CALL
    ) -> Generator[ApiChunk | Wait, None, None]:
        """The request's stream in domain chunks, as waits (`TandemService.stream_waits`), for
        a face that merges or converts them itself; authenticated and validated at once."""
        tenant = self.service.authenticate(caller)
        return self.service.stream_waits(tenant, request_from_proto(message), caller.deadline)

    def stream(
        self, message: generate_pb2.GenerateRequest, caller: Caller = ANONYMOUS_CALL
    ) -> Generator[generate_pb2.GenerateChunk, None, None]:
        """`chunk_waits` as `GenerateChunk` messages, one per chunk, blocking at each wait."""
        return _converted(blocking(self.chunk_waits(message, caller)))

    def audit(
        self,
        message: generate_pb2.AuditRequest,
        caller: Caller = ANONYMOUS_CALL,
        is_active: Callable[[], bool] | None = None,
    ) -> generate_pb2.AuditResponse:
        """Run a greedy or seed-exact request to completion, replay it through the plain
        target and compare token by token (`cluster.api.audit`); `is_active` as for
        `generate`."""
        dtype = check_reference_dtype(message.dtype, "dtype")  # before the caller, as ever
        tenant = self.service.authenticate(caller)
        request = request_from_proto(message.request)
        audited = self.service.auditor.run(tenant, request, dtype, caller.deadline, is_active)
        return audit_to_proto(audited)

    def cancel(self, message: generate_pb2.CancelRequest, caller: Caller = ANONYMOUS_CALL) -> None:
        """Cancel one of the caller's running requests (NOT_FOUND for anyone else's)."""
        self.service.cancel(self.service.authenticate(caller), message.request_id)

    def usage(self, caller: Caller = ANONYMOUS_CALL) -> generate_pb2.TenantUsage:
        """The caller's own usage counters."""
        tenant = self.service.authenticate(caller)
        return usage_to_proto(tenant.name, self.service.usage(tenant))


def _converted(
    chunks: Generator[ApiChunk, None, None],
) -> Generator[generate_pb2.GenerateChunk, None, None]:
    # Closing this closes `chunks`, which frees the request's sessions.
    with closing(chunks):
        for chunk in chunks:
            yield chunk_to_proto(chunk)
