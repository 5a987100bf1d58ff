"""gRPC status codes and `TandemError`s on the replicas' internal API, both directions.

A replica's server answers a `TandemError` with the code its `status` names (`status_code`,
used by `cluster.replica.rpc.CallGuard`, and by `cluster.api.status` for the public API); the
router's client turns a failed call's code back into the error the replica raised
(`error_from_rpc`, by `ERRORS_BY_CODE`), so a remote replica fails as a local one would. On a
Frames stream one entry's failure travels as an `EntryError` (the code's name, the message, the
retry hint) instead of a call's status: `entry_error` builds it, `error_from_entry` reads it
back into the same error a unary call would have raised. A new error class with a code of its
own gets both directions here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from cluster.runtime.errors import (
    ClusterSecretError,
    DeadlineExceededError,
    InvalidArgumentError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseError,
    TandemError,
)
from cluster.wire.metadata import RETRY_AFTER_METADATA_KEY
from protos import replica_pb2


def status_code(status: str) -> grpc.StatusCode:
    """The code named by a `TandemError.status` (a `grpc.StatusCode` member name).

    An unknown name maps to INTERNAL: a typo in an error class must not become a wrong but
    plausible code.
    """
    return grpc.StatusCode.__members__.get(status, grpc.StatusCode.INTERNAL)


def put_status(
    context: Any, code: grpc.StatusCode, message: str, trailers: Sequence[tuple[str, str]] = ()
) -> tuple[grpc.StatusCode, str]:
    """Set a failed call's status on its server context: its trailing metadata (when there are
    any), code and message; returns (code, message), for a gRPC context's `abort`. Every server
    of Tandem fails a call through this: the replicas' (`cluster.replica.rpc.CallGuard`, a
    synchronous gRPC context), the public API's on an event loop
    (`cluster.serve.tandem_servicer.abort_call`) and through Serve's proxy, whose context has
    no `abort` (`cluster.serve.ingress`)."""
    if trailers:
        context.set_trailing_metadata(list(trailers))  # Serve's context adds a list to it
    context.set_code(code)
    context.set_details(message)
    return code, message


ERRORS_BY_CODE: Mapping[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: StaleBaseError,
    grpc.StatusCode.NOT_FOUND: SessionNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: SessionExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: ClusterSecretError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}
"""The error a replica raised, by the status code it sent; any other code means the replica
itself failed: `ReplicaUnavailableError`. RESOURCE_EXHAUSTED (a replica full of sessions, or
of calls) and DEADLINE_EXCEEDED (the request's time ran out) end the request: neither is a
reason to fail over."""


def error_from_rpc(error: grpc.RpcError, replica: str, timed_out: bool = False) -> TandemError:
    """The `TandemError` for a failed call to `replica` (named in unavailability messages).

    `timed_out`: the call ran out the client's own timeout, so a DEADLINE_EXCEEDED is that
    timeout (the replica was too slow to answer), not the replica's: `ReplicaUnavailableError`.
    """
    code = error.code()
    details = error.details() or ""
    slow = timed_out and code == grpc.StatusCode.DEADLINE_EXCEEDED
    error_class = None if slow else ERRORS_BY_CODE.get(code)
    if error_class is ResourceExhaustedError:
        return ResourceExhaustedError(details, retry_after_s=_retry_after_s(error))
    if error_class is not None:
        return error_class(details)
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return ReplicaUnavailableError(f"{replica}: {name}: {details}")


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """When the replica said to retry (its `retry-after-ms` trailer), if it did."""
    trailers = getattr(error, "trailing_metadata", None)
    for key, value in (trailers() if callable(trailers) else None) or ():
        if key == RETRY_AFTER_METADATA_KEY:
            try:
                return int(value) / 1000
            except ValueError:
                return None
    return None


def entry_error(
    status: str, message: str, retry_after_s: float | None = None
) -> replica_pb2.EntryError:
    """A Frames entry's failure: `status` a `TandemError.status` (a code's name), the message,
    and the retry hint in whole milliseconds (at least 1) when there is one."""
    error = replica_pb2.EntryError(status=status_code(status).name, message=message)
    if retry_after_s is not None:
        error.retry_after_ms = min(max(1, round(retry_after_s * 1000)), 2**32 - 1)
    return error


def error_from_entry(entry: replica_pb2.EntryError, replica: str) -> TandemError:
    """The `TandemError` a unary call that failed as `entry` says would raise (see
    `error_from_rpc`); an unknown code name means the replica failed: `ReplicaUnavailableError`
    naming `replica`."""
    code = grpc.StatusCode.__members__.get(entry.status)
    error_class = None if code is None else ERRORS_BY_CODE.get(code)
    if error_class is ResourceExhaustedError:
        retry_after_s = entry.retry_after_ms / 1000 if entry.HasField("retry_after_ms") else None
        return ResourceExhaustedError(entry.message, retry_after_s=retry_after_s)
    if error_class is not None:
        return error_class(entry.message)
    return ReplicaUnavailableError(f"{replica}: {entry.status}: {entry.message}")
