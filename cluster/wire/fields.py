"""The scalar fields of `protos/replica.proto`: token ids, counts and lengths, session ids, and a
session's time limit.

Contract: `*_to_wire` refuses a value its field cannot hold (a token id beyond int32, a count
beyond its unsigned field), naming the field, before anything is sent; `*_from_wire` checks
only what the wire format can tell (a non-empty session id, a set time limit that is not zero).
Token ids against the vocabulary and lengths against the session are the replica's checks.
Each refusal is an `InvalidArgumentError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.runtime.errors import InvalidArgumentError
from protos import replica_pb2

MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1


def session_id_from_wire(session_id: str) -> str:
    """The session id of a request; empty (the proto3 default, so also "unset") is refused."""
    if not session_id:
        raise InvalidArgumentError("session_id must not be empty")
    return session_id


def token_ids_to_wire(token_ids: Sequence[int], what: str) -> list[int]:
    """Token ids as the wire's int32s; ids it cannot hold are refused here, naming the first."""
    ids = [int(token) for token in token_ids]
    for position, token in enumerate(ids):
        if not 0 <= token <= MAX_INT32:
            raise InvalidArgumentError(
                f"{what}[{position}] = {token} is not a token id (0..{MAX_INT32})"
            )
    return ids


def uint_to_wire(value: int, what: str, max_value: int = MAX_UINT64) -> int:
    """A count or length for an unsigned wire field, refused if the field cannot hold it."""
    if isinstance(value, bool) or not 0 <= value <= max_value:
        raise InvalidArgumentError(f"{what} must be in 0..{max_value}, got {value!r}")
    return int(value)


def time_limit_to_wire(time_left_s: float) -> int:
    """Seconds a request has left as `OpenSessionRequest.time_limit_ms`: rounded up, so the
    replica never drops a session before its request's deadline; at least 1 (0 is refused on
    the wire) and at most what the field holds (a longer limit is no limit in practice)."""
    return min(max(math.ceil(time_left_s * 1000), 1), MAX_UINT32)


def time_limit_from_wire(request: replica_pb2.OpenSessionRequest) -> float | None:
    """The session's time limit in seconds; None when unset (no limit, only the idle TTL)."""
    if not request.HasField("time_limit_ms"):
        return None
    if request.time_limit_ms == 0:
        raise InvalidArgumentError("time_limit_ms must be >= 1 when set (unset: no limit)")
    return request.time_limit_ms / 1000
