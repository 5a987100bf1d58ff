"""What drafter and verifier both keep per session, and the checks both apply to requests.

A replica's session is soft state (docs/architecture.md, invariant 2): the committed tokens as
this replica last heard them and a KV cache over them (one record: `SequenceKV`), the sampling
settings and a seeded generator. Everything here can be rebuilt from the router's token history.
A session nobody has used for `session_ttl_s` (its client gone, its router restarted) is
evicted, KV cache and all. A session opened with a time limit (what its request had left) is
dropped once that passes, even if its router is gone: by `evict_idle`, or by the first call that
finds it (DEADLINE_EXCEEDED).

Both components are a `SessionComponent` (`cluster.runtime.component`) over a `SessionTable`,
whose sessions keep their KV in the replica engine's paged pool (`SequenceKV`); the table is
touched by the engine thread only. Admission is by count (`max_sessions`) and by KV memory: the
prompt and a block must fit in the pool, and the session's planned growth beside the others'
(`SessionLimits.kv_overcommit`). Their configs extend `SessionLimits`, which with the
limits' defaults and the block limit lives in `cluster.runtime.limits` (plain data, no torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from cluster.runtime.advance import Advance
from cluster.runtime.block_runner import ModelRunner
from cluster.runtime.constraint import TokenMatcher
from cluster.runtime.draft_block import Verdict
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseError,
)
from cluster.runtime.kv_cache import SequenceKV
from cluster.runtime.limits import DEFAULT_KV_OVERCOMMIT
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution

MAX_SEED = 2**64 - 1
DRAFTER_SEED_SALT = 0x9E3779B97F4A7C15
"""XOR-ed into the request seed by the drafter under the rejection rule, so that its draws are
independent of the verifier's: that rule is only exact when the draft token and the acceptance
test use separate randomness (the seed-exact rule shares the request's own noise instead)."""


@dataclass
class ReplicaSession:
    """One request's state on one replica."""

    kv: SequenceKV
    """Its token sequence, the one record of it here: committed tokens (prompt plus every
    committed generated token), a tentative tail, and the KV over them."""
    sampling: SamplingParams
    generator: torch.Generator
    seed: int = 0
    """The seed the session keeps (`_session_sampling`'s): the request's under the seed-exact
    rule, whose noise it keys."""
    next_row: int | SparseDistribution | torch.Tensor | None = field(default=None)
    """Verifier only: the target's distribution for the next position, kept when a verdict
    deferred its bonus token, in its smallest exact form (the argmax when greedy, else the
    nonzero entries or a dense row); the cache then holds every committed token."""
    constrained: bool = False
    """Its request constrains the generated tokens (a grammar, or `min_tokens`)."""
    matcher: TokenMatcher | None = None
    """Where the session stands in that constraint; None when unconstrained, or on a drafter
    that cannot follow it (which then drafts nothing)."""
    advance: Advance | None = None
    """Verifier only: where the session stops advancing on its own (`cluster.runtime.advance`);
    None: it advances only by the blocks it is sent (not running, or finished)."""
    sink: Callable[[Verdict | Exception], None] | None = None
    """Verifier only: where a running session's own steps report (their verdicts, or the error
    that stopped it), on the engine thread, in order with the answers to its calls."""
    planned_blocks: int = 0
    """KV blocks its admission planned for: the prompt and its growth (`SessionTable.open`)."""
    last_used: float = 0.0
    """When a call last found this session (the table's clock)."""
    expires_at: float | None = None
    """When its request's time runs out (the table's clock); None: no limit."""

    @property
    def committed_length(self) -> int:
        return self.kv.committed_length


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica holds right now."""

    num_sessions: int
    num_cached_tokens: int
    busy_s: float = 0.0
    """Seconds the replica's component has spent serving calls since it started (its engine's
    forward passes and the work between them)."""
    engine: EngineStats | None = None
    """The replica engine's figures (None where no engine runs)."""
    frames_sent: int = 0
    """ReplicaFrames its Frames streams sent since start (0 where none is served)."""
    results_sent: int = 0
    """FrameResults in those frames."""
    frames_received: int = 0
    """RouterFrames its Frames streams received since start."""
    entries_received: int = 0
    """FrameEntries in those frames."""
    sessions_expired: int = 0
    """Sessions the replica dropped past their time limit since start (by its sweep, or
    found expired when a call came); a router's close is not counted."""
    sessions_evicted: int = 0
    """Sessions it dropped for idling past its session TTL since start."""
    index_bytes: int | None = None
    """A suffix drafter's indexes: the bytes they hold (None on other replicas)."""
    index_proposals: int | None = None
    """Its proposals asked for since start."""
    index_proposed: int | None = None
    """Those that proposed at least one token (the hit rate is this over `index_proposals`)."""


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Reject ids outside the model's vocabulary, naming the first offender."""
    for position, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgumentError(
                f"{what}[{position}] = {token} is outside the vocabulary (0..{vocab_size - 1})"
            )


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {seed}")


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


TIME_LIMIT_GRACE_S = 2.0
"""What a replica waits past a session's time limit (the time its request had left) before it
drops the session itself. The router closes its sessions at the request's deadline; the
replica's own limit is the backstop for a router that died, so it must not race that close."""


class SessionTable:
    """Sessions of one replica by id, on one model, with the limits and lookups both sides share."""

    def __init__(
        self,
        model: LoadedModel,
        runner: ModelRunner,
        max_sessions: int,
        max_context_tokens: int,
        session_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_overcommit: float = DEFAULT_KV_OVERCOMMIT,
        time_limit_grace_s: float = TIME_LIMIT_GRACE_S,
    ) -> None:
        """`session_ttl_s`: evict a session idle this long (None: never); `kv_overcommit`:
        the planned growth of open sessions may reach this many times the KV pool;
        `time_limit_grace_s`: how long past its time limit a session is kept."""
        self.model = model
        self.runner = runner
        self.max_sessions = max_sessions
        self.max_context_tokens = max_context_tokens
        self.session_ttl_s = session_ttl_s
        self.time_limit_grace_s = time_limit_grace_s
        self._clock = clock
        self._sessions: dict[str, ReplicaSession] = {}
        self.num_evicted = 0
        """Sessions evicted for idling since the table was made."""
        self.num_expired = 0
        """Sessions dropped past their time limit since the table was made."""
        self.kv_overcommit = kv_overcommit
        self.num_refused = 0
        """Sessions refused at admission since the table was made: for lack of KV memory (now,
        or planned), or with less time left than the queue would keep them waiting."""
        self._planned_blocks = 0
        """The sum of the open sessions' `planned_blocks`."""

    def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        time_limit_s: float | None = None,
        headroom_tokens: int = 0,
        max_new_tokens: int | None = None,
        resumed: bool = False,
    ) -> ReplicaSession:
        """Check and create a session (its owner prefills it); nothing is kept if a check fails.

        `time_limit_s`: seconds its request has left, from now; past them the session is
        dropped (None: no limit, only the idle TTL). Admission is by KV memory, twice: the
        prompt plus `headroom_tokens` (a block and its bonus) must fit in the pool (free or
        not: a prefill waits in the engine for blocks to free up), and the session's planned
        growth (the prompt plus `max_new_tokens`, or the headroom when None, within the
        context limit) must fit beside the open sessions' plans in `kv_overcommit` times the
        pool; else RESOURCE_EXHAUSTED with a retry hint. A `resumed` session (its request
        already runs: a failover) is admitted whatever the plan, and counts in it."""
        if time_limit_s is not None and not time_limit_s > 0:
            raise InvalidArgumentError(f"time_limit_s must be > 0, got {time_limit_s}")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_new(session_id, prompt_tokens)
        self._check_memory(len(prompt_tokens) + headroom_tokens)
        growth = headroom_tokens if max_new_tokens is None else max_new_tokens + 1
        planned = self._check_plan(
            min(len(prompt_tokens) + growth, self.max_context_tokens), resumed
        )
        check_token_ids(prompt_tokens, self.model.vocab_size, "prompt_tokens")
        check_seed(seed)
        now = self._clock()
        grace = self.time_limit_grace_s
        session = ReplicaSession(
            kv=SequenceKV(self.runner, session_id, prompt_tokens),
            sampling=sampling,
            generator=make_generator(seed, self.model.device),
            seed=seed,
            last_used=now,
            expires_at=None if time_limit_s is None else now + time_limit_s + grace,
            planned_blocks=planned,
        )
        self._sessions[session_id] = session
        self._planned_blocks += planned
        return session

    def _check_new(self, session_id: str, prompt_tokens: Sequence[int]) -> None:
        if not session_id:
            raise InvalidArgumentError("session_id must not be empty")
        if session_id in self._sessions:
            raise SessionExistsError(f"session {session_id!r} is already open")
        if len(self._sessions) >= self.max_sessions:
            self.evict_idle()  # abandoned and expired sessions give up their places first
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhaustedError(
                f"replica holds its maximum of {self.max_sessions} sessions"
            )
        if len(prompt_tokens) == 0:
            raise InvalidArgumentError("prompt must hold at least one token")
        self.check_context(len(prompt_tokens))

    def _check_memory(self, tokens: int) -> None:
        """Refuse a session whose prompt and first block could not fit in the whole pool. One
        that fits only once others free their blocks is admitted: its prefill waits in the
        engine for room (the engine preempts only sessions newer than the one growing)."""
        runner = self.runner
        need = -(-min(tokens, self.max_context_tokens) // runner.block_size)
        if need > runner.num_blocks:
            self.num_refused += 1
            raise ResourceExhaustedError(
                f"replica KV memory is too small: a session of {tokens} tokens needs {need} "
                f"blocks of {runner.block_size} tokens, the pool has {runner.num_blocks}; "
                "retry on another replica",
                retry_after_s=1.0,
            )

    def _check_plan(self, tokens: int, resumed: bool = False) -> int:
        """The blocks a session planned to reach `tokens` takes in the plan, if they fit
        beside the open sessions' plans (`kv_overcommit`) or it is `resumed`; else
        RESOURCE_EXHAUSTED."""
        runner = self.runner
        planned = -(-tokens // runner.block_size)
        budget = int(self.kv_overcommit * runner.num_blocks)
        if not resumed and self._sessions and self._planned_blocks + planned > budget:
            self.num_refused += 1
            raise ResourceExhaustedError(
                f"replica KV memory is fully planned: the open sessions may grow to "
                f"{self._planned_blocks} blocks, and {planned} more for this one's "
                f"{tokens} tokens would pass {self.kv_overcommit:g} x the pool's "
                f"{runner.num_blocks}; retry after 1 s or on another replica",
                retry_after_s=1.0,
            )
        return planned

    def check_context(self, length: int) -> None:
        if length > self.max_context_tokens:
            raise ResourceExhaustedError(
                f"context of {length} tokens exceeds the limit of {self.max_context_tokens}"
            )

    def get(self, session_id: str) -> ReplicaSession:
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(
                f"no open session {session_id!r} "
                "(closed, evicted after idling or past its deadline, or never opened)"
            ) from None
        now = self._clock()
        if self._expired(session, now):
            self._drop(session_id)
            self.num_expired += 1
            raise DeadlineExceededError(f"session {session_id!r} passed its deadline")
        session.last_used = now
        return session

    def evict_idle(self, busy: Collection[str] = ()) -> int:
        """Drop every session past its time limit or unused for longer than the TTL, except
        the `busy` ones (a call on them is running); returns how many went."""
        now = self._clock()
        oldest = -float("inf") if self.session_ttl_s is None else now - self.session_ttl_s
        expired = [
            sid for sid, s in self._sessions.items() if self._expired(s, now) and sid not in busy
        ]
        for session_id in expired:
            self._drop(session_id)
        idle = [
            sid for sid, s in self._sessions.items() if s.last_used < oldest and sid not in busy
        ]
        for session_id in idle:
            self._drop(session_id)
        self.num_expired += len(expired)
        self.num_evicted += len(idle)
        return len(expired) + len(idle)

    @staticmethod
    def _expired(session: ReplicaSession, now: float) -> bool:
        return session.expires_at is not None and now >= session.expires_at

    def find(self, session_id: str) -> ReplicaSession | None:
        """The session if it is open and within its time limit (an expired one is dropped),
        else None; it is not marked as used."""
        session = self._sessions.get(session_id)
        if session is not None and self._expired(session, self._clock()):
            self._drop(session_id)
            self.num_expired += 1
            return None
        return session

    def get_at(self, session_id: str, base_length: int) -> ReplicaSession:
        """The session, provided its committed length is `base_length` (invariant 3)."""
        session = self.get(session_id)
        if base_length != session.committed_length:
            raise StaleBaseError(
                f"session {session_id!r} has committed length {session.committed_length}, "
                f"but the request is based on length {base_length}"
            )
        return session

    def remove(self, session_id: str) -> bool:
        return self._drop(session_id)

    def _drop(self, session_id: str) -> bool:
        """Forget a session and free its blocks; False if it was not open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.kv.release()
        self._planned_blocks -= session.planned_blocks
        return True

    def stats(self, busy_s: float = 0.0, engine: EngineStats | None = None) -> ReplicaStats:
        """Safe from any thread: it copies the table in one step (no Python code runs meanwhile)."""
        sessions = list(self._sessions.values())
        return ReplicaStats(
            busy_s=busy_s,
            num_sessions=len(sessions),
            num_cached_tokens=sum(s.kv.num_cached_tokens for s in sessions),
            engine=engine,
            sessions_expired=self.num_expired,
            sessions_evicted=self.num_evicted,
        )
