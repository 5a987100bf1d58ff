"""The interfaces through which the router drives a drafter and a verifier.

The plain `drafter.Drafter` and `verifier.Verifier` satisfy them directly (the in-process
transport); the gRPC transport implements them with a client per replica. The router depends on
these protocols only, so the same router code runs in-process and distributed.

Deadlines: a pool hands each request ports bound to its deadline where it can (the gRPC
clients' `bounded` views stop a call when the request's time runs out, and tell the replica
how long the session may live); in-process ports are not interrupted, and the router itself
checks the deadline before every round.

Waiting: a port that can wait without a thread (the gRPC clients over frames) also has
`<call>_steps` methods (`cluster.routing.waits`); `open_steps`, `draft_steps`, `verify_steps`
and `close_steps` below give the steps of any port, calling a port without them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cluster.routing.waits import Started, Steps, answer, call_steps
from cluster.runtime.constraint import Constraint
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from cluster.runtime.audit import Replay


class DrafterPort(Protocol):
    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
    ) -> int:
        """Open a session; returns its committed length. `max_new_tokens`: how far it may grow
        past the prompt (admission plans for it; None: a block); `resumed`: the request already
        runs (a failover), so the plan does not refuse it; `constraint`: what its generated
        tokens must follow (None: anything)."""
        ...

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> DraftBlock:
        """Check the session is at `base_length`; drop its tokens from `truncate_to` on (a
        speculative block the verdict rejected); append `appended_tokens`; draft
        `num_tokens`."""
        ...

    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        ...


class PredraftPort(Protocol):
    """What a drafter port offers if it pre-drafts (outcome-keyed pre-drafting): optional, so
    not part of `DrafterPort`; the router asks a port that has `predraft` (the in-process
    `Drafter`, `GrpcDrafter`)."""

    def predraft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        block: Sequence[int],
        branches: Sequence[Branch],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> list[PreDraft]:
        """Bring the session to its committed tokens as `draft` does, then draft `num_tokens`
        after each of `branches`, likely outcomes of verifying `block`; the branches drafted
        (some may be left out). The session keeps only its committed tokens."""
        ...


class VerifierPort(Protocol):
    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
    ) -> int:
        """Open a session; returns its committed length. `max_new_tokens`: how far it may grow
        past the prompt (admission plans for it; None: a block); `resumed`: the request already
        runs (a failover), so the plan does not refuse it; `constraint`: what its generated
        tokens must follow (None: anything)."""
        ...

    def verify(self, session_id: str, block: DraftBlock, defer_bonus: bool = False) -> Verdict:
        """Verify `block` and commit the emitted tokens; with `defer_bonus`, an all-accepted
        block emits no bonus token and the next block is verified against the kept p."""
        ...

    def reference(
        self,
        prompt_tokens: Sequence[int],
        served_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        dtype: str = "",
    ) -> Replay:
        """Replay a finished greedy or seed-exact request through the plain target (no
        session, no drafts, no batching; waits while the replica serves calls): the target's
        own token and top-2 gap at each served position. `dtype`: "" the replica's weights,
        "float32" a float32 copy of them."""
        ...

    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        ...


def open_steps(port: DrafterPort | VerifierPort, *args: Any, **kwargs: Any) -> Steps[int]:
    """`port.open_session(...)` as steps."""
    own = getattr(port, "open_session_steps", None)
    if own is not None:
        return own(*args, **kwargs)
    return call_steps(lambda: port.open_session(*args, **kwargs))


def draft_steps(port: DrafterPort, *args: Any, **kwargs: Any) -> Steps[DraftBlock]:
    """`port.draft(...)` as steps."""
    own = getattr(port, "draft_steps", None)
    if own is not None:
        return own(*args, **kwargs)
    return call_steps(lambda: port.draft(*args, **kwargs))


def verify_steps(port: VerifierPort, *args: Any, **kwargs: Any) -> Steps[Verdict]:
    """`port.verify(...)` as steps."""
    own = getattr(port, "verify_steps", None)
    if own is not None:
        return own(*args, **kwargs)
    return call_steps(lambda: port.verify(*args, **kwargs))


def close_steps(port: DrafterPort | VerifierPort, session_id: str) -> Steps[bool]:
    """`port.close_session(session_id)` as steps."""
    own = getattr(port, "close_session_steps", None)
    if own is not None:
        return own(session_id)
    return call_steps(lambda: port.close_session(session_id))


def has_steps(port: DrafterPort | VerifierPort | None) -> bool:
    """Whether `port` waits without a thread (its calls' steps yield their waits; a port
    without, or a gRPC client making unary calls, blocks until it is answered)."""
    return bool(getattr(port, "waits_without_thread", False))


def begin_call(
    pool: Executor, port: DrafterPort | VerifierPort, call: str, *args: Any, **kwargs: Any
) -> Started:
    """`port.<call>(...)` begun now, to finish later (`Started.finish`): sent at once by a
    port with steps; on a thread of `pool` for a port whose calls block (in process)."""
    if has_steps(port):
        return Started(getattr(port, f"{call}_steps")(*args, **kwargs))
    return Started(answer(pool.submit(getattr(port, call), *args, **kwargs)))


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Pinned:
    """The replicas one request is pinned to (they hold its KV caches), until one fails."""

    verifier: VerifierPort
    drafter: DrafterPort | None
    release: Callable[[], None] = field(default=_nothing)
    """Called once when the request ends, whatever the outcome (load accounting)."""
    verifier_id: str = "verifier"
    drafter_id: str = "drafter"
    suffix: DrafterPort | None = None
    """A suffix drafter (`drafter.suffix`), asked before the model drafter; None: none."""
    suffix_id: str = ""


@dataclass(frozen=True)
class Spare:
    """A replica pinned in place of one that failed a request's call."""

    port: Any
    """A `VerifierPort` or a `DrafterPort`, as asked."""
    replica_id: str
    release: Callable[[], None] = field(default=_nothing)


class ReplicaPool(Protocol):
    def pin(
        self,
        speculate: bool,
        deadline: float | None = None,
        tenant: str = "",
        suffix: bool = True,
    ) -> Pinned:
        """Choose the replicas for a new request; `speculate` says whether it needs a drafter.
        `deadline`: the request's `time.monotonic()` deadline, which the ports may honour;
        `tenant`: whose request it is (a tenant's requests share a suffix drafter); `suffix`:
        whether it may use that suffix drafter (False: its tenant keeps its text out of the
        index, and no suffix replica is pinned for it)."""
        ...

    def spare(
        self, side: str, avoid: frozenset[str], deadline: float | None = None
    ) -> Spare | None:
        """Another live replica of `side` ("verifier" or "drafter"), none of `avoid` (the ids
        that failed this request); None if there is none. `deadline` as for `pin`."""
        ...


@dataclass(frozen=True)
class FixedReplicas:
    """One verifier and one drafter for every request: the in-process transport."""

    verifier: VerifierPort
    drafter: DrafterPort | None
    suffix: DrafterPort | None = None

    def pin(
        self,
        speculate: bool,
        deadline: float | None = None,
        tenant: str = "",
        suffix: bool = True,
    ) -> Pinned:
        # In-process calls cannot be cut short: the router checks `deadline` between rounds.
        if not speculate:
            return Pinned(self.verifier, None)
        if not suffix or self.suffix is None:
            return Pinned(self.verifier, self.drafter)
        return Pinned(self.verifier, self.drafter, suffix=self.suffix, suffix_id="suffix")

    @property
    def waits_without_threads(self) -> bool:
        """Whether every port waits without a thread (`has_steps`)."""
        return all(
            port is None or has_steps(port) for port in (self.verifier, self.drafter, self.suffix)
        )

    def spare(
        self, side: str, avoid: frozenset[str], deadline: float | None = None
    ) -> Spare | None:
        return None  # one replica per side: nothing to fail over to
