"""The suffix drafter: drafts what followed the same words in text the tenant already sent or
received, with no model, on replicas that need no accelerator.

A plain class (no Ray, no gRPC) with the session calls of a drafter (`DrafterPort`, and the
`submit_*` forms a Frames stream uses, answered at once), over one `SuffixStore`
(`drafter.suffix_store`): an index per tenant (or per request, `SuffixConfig.scope`) of every prompt
and every committed output its sessions were given. A session is the request's document in its
tenant's index: opening it indexes the prompt, each draft call first indexes the tokens committed
since the last one (`appended_tokens`, as the router sends them) and then proposes a continuation of
the whole history (`SuffixStore.propose`: frequency-scored, variable length, ended where its
confidence falls). Closing it leaves its text in a tenant-scoped index for later requests, until the
tenant's byte cap evicts the oldest.

A proposal is deterministic, so its q is one-hot (the block carries none) and the verifier's rule
stays exact for every sampling rule; an empty block means "nothing recurs": the router then drafts
with the model. The router sends committed tokens only, never a block ahead of its verdict, so the
index never holds a token the target did not produce: a call that would truncate (`truncate_to`) is
refused.

Every call runs on the caller's thread under one lock and returns at once (a proposal costs
O(`max_candidates` x tokens), never O(text held)), so there is no engine: `engine` is a step source
with no steps, and a Frames stream answers each frame's entries together as it reads them
(`cluster.replica.frames`; the servicer is `drafter.suffix_servicer`). Sessions end with their
request (close), or after their time limit or `idle_ttl_s` unused should the router die
(`evict_idle`, which the replica host runs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from cluster.runtime.constraint import Constraint
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    InvalidArgumentError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseError,
)
from cluster.runtime.limits import MAX_BLOCK_TOKENS
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import TIME_LIMIT_GRACE_S, ReplicaStats
from drafter.config import SuffixConfig
from drafter.suffix_store import StoreStats, SuffixStore

R = TypeVar("R")

DEFAULT_IDLE_TTL_S = 600.0
"""A session unused this long is dropped (its router is gone)."""


class NoSteps:
    """The step source of a component with no engine: results complete on the caller's
    thread, which is never an engine's (`cluster.replica.frames.StepSource`)."""

    on_engine_thread = False

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Never called back: there are no steps."""

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        """Nothing to remove."""


@dataclass
class _Session:
    tenant: str
    length: int
    """Tokens committed so far (prompt included): the length the router bases calls on."""
    history: list[int]
    """Those tokens: the context a proposal continues."""
    expires_at: float | None
    used_at: float


class SuffixDrafter:
    """Proposes draft blocks from a tenant's earlier text, one session per request."""

    def __init__(
        self,
        config: SuffixConfig | None = None,
        *,
        vocab_size: int | None = None,
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`vocab_size`: token ids at or above it are refused (None: any id >= 0)."""
        self.config = config or SuffixConfig()
        self.store = SuffixStore(self.config)
        self.engine = NoSteps()
        self._vocab_size = vocab_size
        self._idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._busy_s = 0.0
        self.alive = True

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
        tenant: str = "",
    ) -> int:
        """Open a session on `prompt_tokens`, indexed for `tenant`; returns its length. The
        seed and constraint do not matter to a proposal (its q is one-hot whatever the rule);
        a constrained request is refused (its drafts would have to follow the grammar, which
        this drafter does not track). A request sampled by the rejection rule drafts from
        its own text only, and leaves none for later requests (`SuffixStore.keep_private`:
        a same-seed request's output is not independent of its acceptance draws)."""
        if constraint is not None:
            raise InvalidArgumentError("the suffix drafter does not draft for constrained requests")
        tokens = self._checked(prompt_tokens, "prompt_tokens")
        started = time.perf_counter()
        now = self._clock()
        with self._lock:
            if session_id in self._sessions:
                raise SessionExistsError(f"session {session_id!r} is already open")
            expires_at = None if time_limit_s is None else now + time_limit_s + TIME_LIMIT_GRACE_S
            session = _Session(tenant, len(tokens), list(tokens), expires_at, now)
            self._sessions[session_id] = session
            if not sampling.is_greedy and not sampling.seed_exact:
                self.store.keep_private(session_id)
            self.store.extend(tenant, session_id, tokens)
            self._busy_s += time.perf_counter() - started
        return len(tokens)

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> DraftBlock:
        """Check the session is at `base_length`, index `appended_tokens` (committed since the
        last call), then propose up to `num_tokens` (at most `max_tokens`) tokens; an empty
        block when nothing recurs."""
        if truncate_to is not None:
            raise InvalidArgumentError(
                "the suffix drafter holds committed tokens only: nothing to truncate"
            )
        if not 0 <= num_tokens <= MAX_BLOCK_TOKENS:
            raise InvalidArgumentError(
                f"num_tokens must be in 0..{MAX_BLOCK_TOKENS}, got {num_tokens}"
            )
        appended = self._checked(appended_tokens, "appended_tokens")
        started = time.perf_counter()
        with self._lock:
            session = self._session(session_id)
            if base_length != session.length:
                raise StaleBaseError(
                    f"session {session_id!r} is at length {session.length}, not {base_length}"
                )
            session.length += len(appended)
            session.history.extend(appended)
            session.used_at = self._clock()
            self.store.extend(session.tenant, session_id, appended)
            wanted = min(num_tokens, self.config.max_tokens)
            proposal = (
                self.store.propose(session.tenant, session_id, session.history, wanted)
                if wanted > 0
                else None
            )
            self._busy_s += time.perf_counter() - started
        tokens = () if proposal is None else proposal.tokens
        return DraftBlock(base_length=session.length, tokens=tokens)

    def close_session(self, session_id: str) -> bool:
        """End the session; its text stays in a tenant-scoped index. True if it existed."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return False
            self.store.finish(session.tenant, session_id)
            return True

    def submit_open(self, *args: Any, **kwargs: Any) -> Future[int]:
        """`open_session`, answered at once (a future already done)."""
        return answered(lambda: self.open_session(*args, **kwargs))

    def submit_draft(self, *args: Any, **kwargs: Any) -> Future[DraftBlock]:
        """`draft`, answered at once."""
        return answered(lambda: self.draft(*args, **kwargs))

    def submit_close(self, session_id: str) -> Future[bool]:
        """`close_session`, answered at once."""
        return answered(lambda: self.close_session(session_id))

    def evict_idle(self) -> int:
        """Drop sessions past their time limit or unused for `idle_ttl_s`; how many."""
        now = self._clock()
        with self._lock:
            gone = [
                session_id
                for session_id, session in self._sessions.items()
                if (session.expires_at is not None and now >= session.expires_at)
                or now - session.used_at >= self._idle_ttl_s
            ]
            for session_id in gone:
                session = self._sessions.pop(session_id)
                self.store.finish(session.tenant, session_id)
        return len(gone)

    def stats(self) -> ReplicaStats:
        index = self.index_stats()
        with self._lock:
            return ReplicaStats(
                num_sessions=len(self._sessions),
                num_cached_tokens=index.tokens,
                busy_s=self._busy_s,
                index_bytes=index.nbytes,
                index_proposals=index.proposals,
                index_proposed=index.proposed,
            )

    def index_stats(self) -> StoreStats:
        """What the indexes hold and how often they proposed."""
        with self._lock:
            return self.store.stats()

    def close(self) -> None:
        """Serve nothing more."""
        self.alive = False

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"no session {session_id!r} on this suffix drafter")
        return session

    def _checked(self, tokens: Sequence[int], what: str) -> tuple[int, ...]:
        values = tuple(tokens)
        limit = self._vocab_size
        for position, token in enumerate(values):
            if token < 0 or (limit is not None and token >= limit):
                raise InvalidArgumentError(f"{what}[{position}] = {token} is not a token id")
        return values


def answered(call: Callable[[], R]) -> Future[R]:
    """A future already done with what `call()` returns or raises."""
    future: Future[R] = Future()
    try:
        future.set_result(call())
    except Exception as error:
        future.set_exception(error)
    return future
