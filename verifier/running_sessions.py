"""A verifier's running sessions: sessions that advance on their own, one engine step at a time.

A session opened with an `Advance` (and a sink, where its own steps report) is running: once
open, it is in every engine step (`Engine.keep_running`), verifying a block sent to it if one is
there, else taking a step alone (the target's own next token, or its deferred bonus token: the
verifier's verify pass over an empty block), until `advance` says its output has ended
(`cluster.runtime.advance`).

Contract: `RunningSessions.start` (engine thread, as the session opens) makes a session running
unless it has nothing left to generate. Each step alone hands its verdict to the session's sink,
or the error that stopped it, after which the session no longer advances. A session stops being
stepped once its output has ended, it has been closed or expired, or whoever opened it has gone
(`gone`: a stream ended, an open given up). Its verify pass is the verifier's (`verify_at`);
nothing here reads logits or applies a rule.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.runtime.advance import Advance
from cluster.runtime.call_scope import Gone
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.engine import Engine
from cluster.runtime.session import ReplicaSession, SessionTable
from cluster.runtime.task import Task

VerifyAt = Callable[[ReplicaSession, DraftBlock, bool], Task[Verdict]]
"""One verify pass of a block, based where the session stands (`Verifier._verify_at`)."""


class RunningSessions:
    """Steps a verifier's running sessions on `engine`, over the sessions of `sessions`, each
    step alone a `verify_at` pass over an empty block."""

    def __init__(self, engine: Engine, sessions: SessionTable, verify_at: VerifyAt) -> None:
        self._engine = engine
        self._sessions = sessions
        self._verify_at = verify_at

    def start(
        self,
        advance: Advance,
        sink: Callable[[Verdict | Exception], None],
        gone: Gone | None,
        session_id: str,
        session: ReplicaSession,
    ) -> None:
        """Make an opened session running (engine thread): from its next step on, the engine
        asks `_next_step` for its work whenever no call of it is queued."""
        if session.committed_length >= advance.max_length:
            return  # nothing left to generate
        session.advance, session.sink = advance, sink
        self._engine.keep_running(session_id, lambda: self._next_step(session_id, gone))

    def _next_step(self, session_id: str, gone: Gone | None) -> Task[None] | None:
        """A running session's own next step (the target's next token, or its deferred bonus
        token), or None once it has ended, been closed, run out of time or lost its caller."""
        session = self._sessions.find(session_id)
        if session is None or session.advance is None or session.sink is None:
            return None
        if gone is not None and gone.is_set():
            session.advance = None
            return None
        return self._step_alone(session, session.sink)

    def _step_alone(
        self, session: ReplicaSession, sink: Callable[[Verdict | Exception], None]
    ) -> Task[None]:
        empty = DraftBlock(base_length=session.committed_length, tokens=())
        try:
            verdict = yield from self._verify_at(session, empty, False)
        except Exception as error:  # its router hears of it; the session stops advancing
            session.advance = None
            sink(error)
            return
        sink(verdict)
