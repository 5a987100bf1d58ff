"""One request's link to its drafter: which replica, its session's opening, and what the session
holds as far as the router knows.

`DrafterLink` is the only writer of this state; what callers do to it are its methods: `open`
the session (now, or deferred until first `ready`), `ready` (waits, returning the port once the
session is open), `call` (what a draft call must send, `DrafterView.call`), `move_to` a spare
(failover), `drop` it (the request goes on with the target alone) and `close` the session. A
link with no port (`port` None) has no drafter: the request drafts by lookup or not at all.

Plain bookkeeping; its I/O is the waits it yields (`cluster.routing.waits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.routing.ports import DrafterPort, closed_quietly
from cluster.routing.waits import Started, Waits
from cluster.runtime.kv_cache import common_prefix_length

Opening = Callable[[DrafterPort], Waits[int]]
"""How the request's session is opened on a drafter: the port's `open_session` call."""


@dataclass
class DrafterView:
    """What the drafter's session holds, as far as the router knows: the committed history up
    to `agreed`, then `assumed` (blocks drafted ahead, taken as accepted)."""

    agreed: int
    """The drafter's session holds the history's first `agreed` tokens."""
    assumed: list[int] = field(default_factory=list)
    """What it holds after them: tokens not (yet) committed."""

    @property
    def length(self) -> int:
        """The drafter session's committed length (a call's `base_length`)."""
        return self.agreed + len(self.assumed)

    def call(
        self, history: Sequence[int], ahead: Sequence[int] = ()
    ) -> tuple[int, int | None, list[int]]:
        """What a call must send for the drafter's session to hold `history` then `ahead`:
        (its base length, where to truncate it (None: nowhere), the tokens to append); the
        view then holds that. O(tokens since the last call)."""
        wanted = [*history[self.agreed :], *ahead]
        kept = common_prefix_length(self.assumed, wanted)
        base = self.length
        truncate_to = self.agreed + kept if kept < len(self.assumed) else None
        appended = wanted[kept:]
        self.agreed, self.assumed = len(history), list(ahead)
        return base, truncate_to, appended


class DrafterLink:
    """The drafter of one request (session `session_id`), from its pin to its close."""

    def __init__(
        self, port: DrafterPort | None, replica_id: str, session_id: str, committed: int
    ) -> None:
        """`port`: the pinned drafter (None: none); its session is to hold the history's first
        `committed` tokens once opened (`open`)."""
        self._port = port
        self._replica_id = replica_id
        self._session_id = session_id
        self._view = DrafterView(agreed=committed)
        self._opening: Started | None = None
        """The session being opened in the background; None once known open."""
        self._opener: Callable[[], Started] | None = None
        """Opens the session when first needed (`ready`); None: it is open or opening already.
        Set while the gate holds the target alone at the request's start: until then, the
        session does not exist and nothing closes it."""

    @property
    def port(self) -> DrafterPort | None:
        """The drafter (None: the request goes on without one)."""
        return self._port

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def open(self, opening: Opening, *, deferred: bool = False) -> None:
        """Open the session with `opening` on the drafter: in the background now, or, if
        `deferred`, once `ready` first asks for it. No-op without a drafter."""
        port = self._port
        if port is None:
            return
        if deferred:
            self._opener = lambda: Started(opening(port))
        else:
            self._opening = Started(opening(port))

    def ready(self) -> Waits[DrafterPort]:
        """Waits, returning the drafter once its session is open (opening it first if that was
        deferred; waiting for it; raising what opening raised)."""
        assert self._port is not None
        if self._opener is not None:
            self._opening, self._opener = self._opener(), None
        if self._opening is not None:
            yield from self._opening.finish()
            self._opening = None
        return self._port

    def call(
        self, history: Sequence[int], ahead: Sequence[int] = ()
    ) -> tuple[int, int | None, list[int]]:
        """What a draft call must send for the session to hold `history` then `ahead`
        (`DrafterView.call`); the view then holds that."""
        return self._view.call(history, ahead)

    def held(self) -> DrafterView:
        """A copy of what the session holds now, to take back a refused call with (`refused`)."""
        return DrafterView(self._view.agreed, list(self._view.assumed))

    def refused(self, held: DrafterView) -> None:
        """The drafter refused the call made since `held` (taking none of it): its session
        holds what it held."""
        self._view = held

    def move_to(self, port: DrafterPort, replica_id: str, committed: int, opening: Opening) -> None:
        """Go on on the spare drafter `port`: its session, opened now with `opening`, is to
        hold the history's first `committed` tokens. The old session is the caller's to close."""
        self._port, self._replica_id = port, replica_id
        self._view = DrafterView(agreed=committed)
        self._opener = None
        self._opening = Started(opening(port))

    def drop(self, committed: int) -> None:
        """Go on with the target alone (and prompt lookup): no drafter from here; `committed`:
        the history's length now. The old session is the caller's to close."""
        self._port, self._opening, self._opener = None, None, None
        self._view = DrafterView(agreed=committed)

    def close(self) -> Waits[None]:
        """Close the session, once it has opened (if opening failed, or was deferred and never
        asked for, nothing is), best effort. Yields its waits."""
        if self._port is None or self._opener is not None:  # never opened
            return
        opening, self._opening = self._opening, None
        if opening is not None:
            try:
                yield from opening.finish()
            except Exception:  # it never opened: nothing to close
                return
        yield from closed_quietly("drafter", self._port, self._session_id)
