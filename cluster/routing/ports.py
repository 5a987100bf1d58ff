"""The interfaces through which the router drives a drafter and a verifier.

Every call is waits (`cluster.routing.waits`): a generator that yields a `Wait` on a future
wherever it waits for the replica, so that one driver runs any number of requests without a
thread each. The gRPC clients implement these protocols over each replica's Frames stream
(`cluster.routing.grpc_drafter`, `cluster.routing.grpc_verifier`); in one process,
`cluster.local.InProcess` adapts the plain `Drafter`, `SuffixDrafter` and `Verifier` (their
`submit_*` futures). The router depends on these protocols only, so the same router code runs
in-process and distributed. `closed_quietly` closes a session on either, best effort.

A verifier session is *running* when opened with an `Advance` (`cluster.runtime.advance`): it
advances on its own, and reports each step, and the verdict of every block the router posts
(`post`), to the request's `SessionEvents` (`cluster.routing.session_events`).

Deadlines: a pool hands each request ports bound to its deadline where it can (the gRPC
clients' `bounded` views stop a call when the request's time runs out, and tell the replica
how long the session may live); in-process ports are not interrupted, and the router itself
checks the deadline before every round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits
from cluster.runtime.advance import Advance
from cluster.runtime.constraint import Constraint
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.runtime.audit import Replay

logger = logging.getLogger(__name__)


class DrafterPort(Protocol):
    """A drafter (a model's, or a suffix drafter) as the router calls it."""

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
        tenant: str = "",
    ) -> Waits[int]:
        """Open a session; returns its committed length. `max_new_tokens`: how far it may grow
        past the prompt (admission plans for it; None: a block); `resumed`: the request already
        runs (a failover), so the plan does not refuse it; `constraint`: what its generated
        tokens must follow (None: anything); `tenant`: whose request it is (a suffix drafter
        drafts from that tenant's text only)."""
        ...

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> Waits[DraftBlock]:
        """Check the session is at `base_length`; drop its tokens from `truncate_to` on (a
        speculative block the verdict rejected); append `appended_tokens`; draft
        `num_tokens`."""
        ...

    def close_session(self, session_id: str) -> Waits[bool]:
        """Free the session; True if it existed."""
        ...


class PredraftPort(Protocol):
    """What a drafter port offers if it pre-drafts (outcome-keyed pre-drafting): optional, so
    not part of `DrafterPort`; the router asks a port that has `predraft`."""

    def predraft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        block: Sequence[int],
        branches: Sequence[Branch],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> Waits[list[PreDraft]]:
        """Bring the session to its committed tokens as `draft` does, then draft
        `num_tokens` after each of `branches`, likely outcomes of verifying `block`; the
        branches drafted (some may be left out). The session keeps only its committed
        tokens."""
        ...


class VerifierPort(Protocol):
    """A verifier as the router calls it."""

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
        advance: Advance | None = None,
        events: SessionEvents | None = None,
    ) -> Waits[int]:
        """Open a session; returns its committed length (`DrafterPort.open_session`).
        With `advance`, the session runs: it advances on its own until its output ends, and
        reports each of its own steps to `events`."""
        ...

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        """Send `block` to be verified from where the session stands when the verifier takes
        it (dropped if the session no longer holds what it assumes); its verdict, or the error
        it failed with, reaches `events` under `post_id`. With `defer_bonus`, a block whose
        every token is accepted emits no bonus token and the next block is verified against
        the kept p."""
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
        "float32" a float32 copy of them. Blocking (the audit's, off the hot path)."""
        ...

    def close_session(self, session_id: str) -> Waits[bool]:
        """Free the session; True if it existed."""
        ...


def closed_quietly(side: str, port: DrafterPort | VerifierPort, session_id: str) -> Waits[None]:
    """Close a session on `port` (the `side`'s), best effort: a replica that cannot be reached,
    is too busy to take the call or fails it drops the session itself after its time limit or
    TTL. Yields its waits."""
    try:
        yield from port.close_session(session_id)
    except Exception as error:
        logger.warning("could not close session %s on the %s: %s", session_id, side, error)


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class StepCosts:
    """The pinned replicas' step cost curves as each measured them at start-up (seconds =
    base + per token x tokens; `EngineStats.startup_base_s`): what a request's plan knows of
    the machine before it has timed a round."""

    draft_base_s: float
    draft_per_token_s: float
    verify_base_s: float
    verify_per_token_s: float
    shared_cores: bool = False
    """The two run their forward passes on the same CPU cores (one node, no GPU, no simulated
    device): a step the verifier takes on its own then slows the draft a block waits on."""

    @property
    def draft_step_s(self) -> float:
        """Seconds of one drafter step of one token."""
        return self.draft_base_s + self.draft_per_token_s

    def verify_s(self, k: int) -> float:
        """Seconds of a verifier step of a k-token block (k + 1 tokens)."""
        return self.verify_base_s + self.verify_per_token_s * (k + 1)

    @property
    def draft_ratio(self) -> float:
        """The drafter's one-token step over the verifier's."""
        return self.draft_step_s / self.verify_s(0)


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
    step_costs: StepCosts | None = None
    """The verifier's and drafter's start-up measurements; None where either is unknown."""


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

    def spare(
        self, side: str, avoid: frozenset[str], deadline: float | None = None
    ) -> Spare | None:
        return None  # one replica per side: nothing to fail over to
