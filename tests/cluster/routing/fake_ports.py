"""Port fakes for router tests: in-process ports (`cluster.local.InProcess`) with some of their
calls, or some of a verifier's answers, changed.

A port call is waits (`cluster.routing.waits`), and a verifier answers through the request's
events (`cluster.routing.session_events`): the verdict of each block posted to it, and each
step its running session takes alone. So a fake fails a call by raising from inside its steps
(they stay a generator), and fails a verifier's answer by pushing the error into the events in
its place, as a replica that refuses a block or loses the session does.

- `Wrapper`: hands every call on to an in-process port, counting them (`calls`), and every
  answer through `hand` (the hook a fake overrides); the component's own methods (`stats()`,
  `close()`, ...) are reachable through it.
- `Dying`: answers so many times, then is gone (a killed replica): every later call fails and
  every session's next answer is the error.
- `Refusing`: its sessions' answers go through until so many have, then the next is an error
  (the session stops there, as a verifier's does when a step fails); calls go through.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from cluster.local import InProcess
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.runtime.predraft import PreDraft

Answer = Verdict | Exception


class Wrapper:
    """A port over `target` (a plain component, wrapped in `InProcess`, or a port already):
    every call handed on, and counted by name in `calls` ("open", "draft", "predraft", "post",
    "close"); every answer of a verifier's sessions handed to the router through `hand`."""

    def __init__(self, target: Any) -> None:
        self.port: InProcess = target if isinstance(target, InProcess) else InProcess(target)
        self.calls: Counter[str] = Counter()

    @property
    def component(self) -> Any:
        """The plain component behind the port."""
        return self.port.component

    def __getattr__(self, name: str) -> Any:
        if name == "port":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.port.component, name)

    def hand(self, session_id: str, post_id: int | None, answer: Answer) -> Answer | None:
        """What reaches the router in place of `answer` (of the block posted as `post_id`,
        or of a step alone: None), or None for nothing. Called on the thread that answered."""
        return answer

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        *args: Any,
        events: SessionEvents | None = None,
        **kwargs: Any,
    ) -> Waits[int]:
        self.calls["open"] += 1
        if events is not None:
            kwargs["events"] = Handed(events, session_id, self.hand)
        return (yield from self.port.open_session(session_id, prompt_tokens, *args, **kwargs))

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        self.calls["draft"] += 1
        return (yield from self.port.draft(*args))

    def predraft(self, *args: Any, **kwargs: Any) -> Waits[list[PreDraft]]:
        self.calls["predraft"] += 1
        return (yield from self.port.predraft(*args, **kwargs))

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        self.calls["post"] += 1
        handed = Handed(events, session_id, self.hand)
        self.port.post(session_id, block, defer_bonus, handed, post_id)  # type: ignore[arg-type]

    def close_session(self, session_id: str) -> Waits[bool]:
        self.calls["close"] += 1
        return (yield from self.port.close_session(session_id))

    def reference(self, *args: Any, **kwargs: Any) -> Any:
        return self.port.reference(*args, **kwargs)


class Handed:
    """A request's `SessionEvents` as a port hands them its session's answers: each goes
    through `hand(session_id, post_id, answer)` first (what `InProcess` calls on its events:
    `report`, a running session's sink, and `answer`, a posted block's future)."""

    def __init__(self, events: SessionEvents, session_id: str, hand: Any) -> None:
        self._events = events
        self._session_id = session_id
        self._hand = hand

    def push(self, post_id: int | None, item: Answer) -> None:
        handed = self._hand(self._session_id, post_id, item)
        if handed is not None:
            self._events.push(post_id, handed)

    def report(self, item: Answer) -> None:
        self.push(None, item)

    def answer(self, post_id: int, future: Future[Verdict]) -> None:
        def answered(done: Future[Verdict]) -> None:
            error = done.exception()
            self.push(post_id, done.result() if error is None else _exception(error))

        future.add_done_callback(answered)


def _exception(error: BaseException) -> Exception:
    return error if isinstance(error, Exception) else RuntimeError(str(error))


class Dying(Wrapper):
    """A replica that answers `calls` times, then is gone (its process killed): a call (open,
    draft, pre-draft, post, close) and each answer of a verifier's session count. Every later
    call fails with ReplicaUnavailableError, as the gRPC client's do for an unreachable
    replica; a session's next answer is that error (its stream failed), and nothing after.
    `refused`: the calls and answers that failed."""

    def __init__(self, target: Any, calls: int) -> None:
        super().__init__(target)
        self._calls_left = calls
        self._lock = threading.Lock()
        self._told: set[str] = set()
        """Sessions whose router has been told the replica is gone."""
        self.refused = 0

    def _answers(self) -> bool:
        """Whether the replica is still there for one more answer (counting it)."""
        with self._lock:
            if self._calls_left > 0:
                self._calls_left -= 1
                return True
            self.refused += 1
            return False

    def _gone(self, what: str) -> ReplicaUnavailableError:
        return ReplicaUnavailableError(f"{what}: UNAVAILABLE: the replica is gone")

    def hand(self, session_id: str, post_id: int | None, answer: Answer) -> Answer | None:
        with self._lock:
            if session_id in self._told:
                return None  # its stream has failed: nothing more arrives
        if self._answers():
            return answer
        with self._lock:
            self._told.add(session_id)
        return self._gone("session")

    def open_session(self, *args: Any, **kwargs: Any) -> Waits[int]:
        if not self._answers():
            raise self._gone("open_session")
        return (yield from super().open_session(*args, **kwargs))

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        if not self._answers():
            raise self._gone("draft")
        return (yield from super().draft(*args))

    def predraft(self, *args: Any, **kwargs: Any) -> Waits[list[PreDraft]]:
        if not self._answers():
            raise self._gone("predraft")
        return (yield from super().predraft(*args, **kwargs))

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        with self._lock:
            gone = self._calls_left <= 0
        if gone:  # the block never reaches it; what the router hears is the loss
            Handed(events, session_id, self.hand).push(post_id, self._gone("post"))
            return
        super().post(session_id, block, defer_bonus, events, post_id)

    def close_session(self, session_id: str) -> Waits[bool]:
        if not self._answers():
            raise self._gone("close_session")
        return (yield from super().close_session(session_id))


class Refusing(Wrapper):
    """A verifier whose sessions' first `answers` answers (verdicts of posted blocks and steps
    taken alone, counted over all its sessions) reach the router, and whose next one is
    `error` instead; that session says nothing more (a verifier's session stops when a step
    fails). Calls go through, so a router that fails over can still close the session the
    error left there. `refused`: the errors sent."""

    def __init__(self, target: Any, answers: int, error: Exception) -> None:
        super().__init__(target)
        self._answers_left = answers
        self._error = error
        self._lock = threading.Lock()
        self._stopped: set[str] = set()
        self.refused = 0

    def hand(self, session_id: str, post_id: int | None, answer: Answer) -> Answer | None:
        with self._lock:
            if session_id in self._stopped:
                return None
            if self._answers_left > 0:
                self._answers_left -= 1
                return answer
            self._stopped.add(session_id)
            self.refused += 1
            return self._error
