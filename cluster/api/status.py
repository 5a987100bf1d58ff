"""What a client of the public `tandem.v1.Tandem` API sees when a call fails.

Contract: `status_of(error)` turns any exception into a gRPC `(code, message)` pair. A
`TandemError` keeps its own status (the name-to-code mapping is `cluster.wire.status.status_code`,
shared with the replica servers) and its message, which is written for the caller. Anything
else is a bug: its traceback is logged here and the client gets INTERNAL with the fixed message
`INTERNAL_ERROR_MESSAGE`, never the exception's text.

`trailers_of(error)` is the trailing metadata to send with it: `retry-after-ms` for a limit
that frees up with time (see `cluster.api.tenants`); the message of such an error also ends with
"; retry in N s", which is all a client gets through Ray Serve's proxy.

Every door of the public API uses it (the one servicer, `cluster.serve.tandem_servicer`, on the
router's own server and through Serve's proxy), so the same failure reaches a client with the
same code and words either way.
"""

from __future__ import annotations

import logging
import math
import re

import grpc

from cluster.runtime.errors import TandemError
from cluster.wire.status import status_code

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error"
"""The only details a client gets for an unexpected server-side exception."""


RETRY_AFTER_METADATA_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying."""
RETRY_IN_MESSAGE = re.compile(r"; retry in (\d+(?:\.\d+)?) s$")
"""How a message that says when to retry ends (what `cluster.api.client` reads)."""


def trailers_of(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata a client should get with `error`: when to retry, if known."""
    retry_after_s = getattr(error, "retry_after_s", None)
    if isinstance(error, TandemError) and isinstance(retry_after_s, float | int):
        return ((RETRY_AFTER_METADATA_KEY, str(math.ceil(retry_after_s * 1000))),)
    return ()


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a client should get for `error`."""
    if isinstance(error, TandemError):
        message = str(error)
        retry_after_s = getattr(error, "retry_after_s", None)
        if isinstance(retry_after_s, float | int) and not RETRY_IN_MESSAGE.search(message):
            # Serve's proxy drops the trailers of a failed call: the message carries it too.
            message = f"{message}; retry in {retry_after_s:.1f} s"
        return status_code(error.status), message
    logger.error("request failed unexpectedly", exc_info=error)
    return grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE
