"""What drafter and verifier both are: a model's sessions under one lock, and the calls on them.

`SessionComponent` holds the `SessionTable` (`verifier.runtime.session`), its `BusyLock` and the
session calls both sides serve (open, close, evict, stats); each side adds its own call
(`draft`, `verify`) and may derive the sampling and seed a session keeps (`_session_sampling`).
A plain class: no Ray, no gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from verifier.runtime.models import LoadedModel
from verifier.runtime.sampling import SamplingParams
from verifier.runtime.session import (
    BusyLock,
    ReplicaStats,
    SessionLimits,
    SessionTable,
    synchronized,
)

C = TypeVar("C", bound=SessionLimits)


class SessionComponent(Generic[C]):
    """What drafter and verifier both are: sessions on one model, under one `BusyLock`, with
    the calls on them both serve. Each side adds its own call and may adjust the sampling and
    seed a session keeps (`_session_sampling`)."""

    def __init__(self, model: LoadedModel, config: C) -> None:
        self._lock = BusyLock()
        self.config = config
        self._model = model
        self._sessions = SessionTable(
            model, config.max_sessions, config.max_context_tokens, config.session_ttl_s
        )

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    @synchronized
    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
    ) -> int:
        """Open a session and prefill its cache; returns the committed length.

        `time_limit_s`: seconds the request has left; once they pass the session is dropped
        and a call on it raises `DeadlineExceededError` (None: only the idle TTL applies)."""
        own_sampling, own_seed = self._session_sampling(sampling, seed)
        session = self._sessions.open(
            session_id, prompt_tokens, own_sampling, own_seed, time_limit_s
        )
        return len(session.tokens)

    def _session_sampling(self, sampling: SamplingParams, seed: int) -> tuple[SamplingParams, int]:
        """The sampling settings and seed a new session keeps: the request's, unless a side
        derives its own."""
        return sampling, seed

    @synchronized
    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        return self._sessions.remove(session_id)

    @synchronized
    def evict_idle(self) -> int:
        """Evict the sessions past their time limit or idle past the TTL (the replica host
        calls this every second); returns how many went."""
        return self._sessions.evict_idle()

    @synchronized
    def stats(self) -> ReplicaStats:
        return self._sessions.stats(busy_s=self._lock.busy_s)
