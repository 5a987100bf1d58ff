"""cluster.wire.status: a `TandemError`'s status name to its gRPC code, and a failed call's code
back to the error the replica raised."""

from __future__ import annotations

import grpc
import pytest

from cluster.runtime import errors
from cluster.runtime.errors import ResourceExhaustedError
from cluster.wire.metadata import RETRY_AFTER_METADATA_KEY
from cluster.wire.status import error_from_rpc, status_code


@pytest.mark.parametrize(
    "error_class",
    [
        errors.InvalidArgumentError,
        errors.StaleBaseError,
        errors.SessionNotFoundError,
        errors.SessionExistsError,
        errors.ResourceExhaustedError,
        errors.ReplicaUnavailableError,
        errors.TandemError,
    ],
)
def test_every_error_status_names_a_grpc_code(error_class: type[errors.TandemError]) -> None:
    assert status_code(error_class.status).name == error_class.status


def test_unknown_status_name_is_internal() -> None:
    assert status_code("NOT_A_CODE") == grpc.StatusCode.INTERNAL


def test_a_replicas_refusal_keeps_its_retry_hint() -> None:
    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "replica KV memory is fully planned"

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return ((RETRY_AFTER_METADATA_KEY, "1500"),)

    error = error_from_rpc(Refused(), "verifier")
    assert isinstance(error, ResourceExhaustedError) and error.retry_after_s == 1.5
