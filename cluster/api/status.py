"""What a client of the public `tandem.v1.Tandem` API sees when a call fails.

Contract: `status_of(error)` turns any exception into a gRPC `(code, message)` pair. A
`TandemError` keeps its own status (the name-to-code mapping is `cluster.replica.rpc.status_code`,
shared with the replica servers) and its message, which is written for the caller. Anything
else is a bug: its traceback is logged here and the client gets INTERNAL with the fixed message
`INTERNAL_ERROR_MESSAGE`, never the exception's text.

`trailers_of(error)` is the trailing metadata to send with it: `retry-after-ms` for a limit
that frees up with time (see `cluster.api.tenants`).

Both public fronts use it, the plain gRPC servicer (`tests.cluster.grpc_front`) and the Ray Serve
ingress, so the same failure reaches a client with the same code and words either way.
"""

from __future__ import annotations

import logging
import math

import grpc

from cluster.replica.rpc import status_code
from cluster.runtime.errors import TandemError

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error"
"""The only details a client gets for an unexpected server-side exception."""


RETRY_AFTER_METADATA_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying."""


def trailers_of(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata a client should get with `error`: when to retry, if known."""
    retry_after_s = getattr(error, "retry_after_s", None)
    if isinstance(error, TandemError) and isinstance(retry_after_s, float | int):
        return ((RETRY_AFTER_METADATA_KEY, str(math.ceil(retry_after_s * 1000))),)
    return ()


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a client should get for `error`."""
    if isinstance(error, TandemError):
        return status_code(error.status), str(error)
    logger.error("request failed unexpectedly", exc_info=error)
    return grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE
