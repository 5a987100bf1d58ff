"""Errors every Tandem component raises, each tied to the gRPC status a client should see.

The status is a plain name (the `grpc.StatusCode` member name) so that this module, and the
pure code that raises these errors, never imports gRPC; the servicers map the name to a code.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base class: a message meant for the caller, and the gRPC status it maps to."""

    status: str = "INTERNAL"


class InvalidArgumentError(TandemError, ValueError):
    """The request itself is wrong (empty prompt, NaN temperature, unknown token id...)."""

    status = "INVALID_ARGUMENT"


class StaleBaseError(TandemError):
    """Work based on a committed length that does not match the session's (invariant 3)."""

    status = "FAILED_PRECONDITION"


class SessionNotFoundError(TandemError, KeyError):
    """No session with this id on this replica (closed, evicted, expired, or never opened)."""

    status = "NOT_FOUND"

    def __str__(self) -> str:
        # KeyError quotes its argument; the message is meant to be read as is.
        return str(self.args[0]) if self.args else ""


class SessionExistsError(TandemError):
    """A session with this id is already open on this replica."""

    status = "ALREADY_EXISTS"


class ResourceExhaustedError(TandemError):
    """A limit was reached (sessions, context length, queue depth, KV memory)."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When set, the limit is transient (KV memory held by other sessions): the caller may
        retry after about this many seconds. Servers send it as `retry-after-ms` metadata."""

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:
        # Ray pickles exceptions across processes: rebuild with the retry hint.
        return (type(self), (str(self), self.retry_after_s))


class CancelledError(TandemError):
    """The caller gave up the call (it was cancelled or timed out, or its connection dropped):
    its work was dropped before its next step."""

    status = "CANCELLED"


class DeadlineExceededError(TandemError):
    """The request ran out of the time its caller gave it; its work stopped and its sessions
    were freed. Not a replica failure: nothing is retried elsewhere."""

    status = "DEADLINE_EXCEEDED"


class ClusterSecretError(TandemError):
    """A replica refused a call for lack of the cluster's shared secret (UNAUTHENTICATED on the
    internal API). To a public client this is the service's own misconfiguration: INTERNAL."""

    status = "INTERNAL"


class ReplicaUnavailableError(TandemError):
    """A replica could not be reached or did not answer: down, restarting, or slower than the
    client's own per-call timeout.

    Also raised for a status with no error class of its own (INTERNAL, UNIMPLEMENTED...).
    Replicas hold only soft state (docs/architecture.md, invariant 2), so the caller may reopen the
    session on another replica from its own token history.
    """

    status = "UNAVAILABLE"
