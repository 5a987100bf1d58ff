"""Failover: moving a request's sessions off replicas that fail it, for the router.

Replicas hold only soft state and the router holds every committed token, so when
a replica fails a call (unreachable, or it no longer knows the session) the request moves on.
A verifier is replaced by a spare of the pool, whose session is opened on the whole history
(prompt and committed tokens): tokens the lost one committed but never reported are generated
again, and blocks posted to it are dropped (the router posts afresh); so is one that refuses
the session for lack of KV memory, at open (its planned growth does not fit: sessions are
opened planned for what is left of `max_tokens`) or mid-request; a drafter is replaced
the same way, or, with no spare, the request goes on with the target alone; so it does, with no
spare sought, when its drafter refuses at a limit of its own (RESOURCE_EXHAUSTED: a context
smaller than the verifier's, or a full session table). Greedy output is
the same as without the failure, and so is seed-exact output (its noise is keyed by position);
rejection-rule output keeps its distribution (the spare's generator starts afresh, so such a
request is no longer repeatable across the failure). At most
`MAX_FAILOVERS` per request, then the error goes to the caller.

`Failover` does this for one router: it opens a request's verifier session and replaces a
failed replica in the request's `Generation` (a drafter through its `DrafterLink`: `move_to` a
spare, or `drop`); a session left on a replica the request moved from is closed in the
background, best effort, off the request's path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.routing.generation import Generation
from cluster.routing.ports import ReplicaPool, closed_quietly
from cluster.routing.waits import Started, Waits, finishing, run
from cluster.runtime.errors import (
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionNotFoundError,
    TandemError,
)

logger = logging.getLogger(__name__)


MAX_FAILOVERS = 4
"""Replicas one request may replace (both sides together) before it fails."""
LOST = (ReplicaUnavailableError, SessionNotFoundError)
"""What a replica raises when the request's session there is gone: fail over. Never
`DeadlineExceededError` (the request is out of time) nor `ResourceExhaustedError` (a limit)."""
VERIFIER_MOVES = (*LOST, ResourceExhaustedError)
"""What moves a request's verification to a spare verifier mid-request: LOST, or a verifier
whose KV pool cannot hold the session's growth (a spare may have room; the full one's session
is closed, freeing its blocks)."""
DRAFTER_FAILED = Exception
"""What a drafter call may raise without failing the request: LOST fails over to a spare
drafter; anything else (a limit of its own, a refusal, an internal fault) ends drafting for the
request, which goes on with the target alone (the drafter is optional). Only the request's own
deadline, checked first, ends the request."""


class Failover:
    """One router's failover: spares from `replicas`, and `drafter_degraded(cause)` called
    when a request's drafting stops for good."""

    def __init__(self, replicas: ReplicaPool, drafter_degraded: Callable[[str], None]) -> None:
        self._replicas = replicas
        self._drafter_degraded = drafter_degraded

    def open_verifier(self, gen: Generation, resumed: bool = False) -> Waits[None]:
        """Open the request's session on its verifier, over the whole history (the prompt at
        first; after a failover, every committed token too), planned to grow by what is left
        of `max_tokens`, running (`Generation.advance`) and reporting to `gen.events`; fail
        over while that fails or the verifier has no room for it. `resumed`: the request
        already ran on another verifier (a failover), so no plan may refuse it: it would fail
        midway. Yields its waits (`cluster.routing.waits`)."""
        while True:
            request = gen.request
            try:
                yield from gen.verifier.open_session(
                    gen.session_id,
                    gen.history,
                    request.sampling,
                    request.seed,
                    max_new_tokens=gen.remaining,
                    resumed=resumed,
                    constraint=gen.constraint,
                    advance=gen.advance,
                    events=gen.events if gen.advance is not None else None,
                )
                gen.heard_at = gen.silent_from = gen.now()
                gen.liveness = None  # the failed verifier's check, if any, is moot
                return
            except VERIFIER_MOVES as error:
                self.replace(gen, "verifier", error)

    def move_verifier(self, gen: Generation, error: Exception) -> Waits[None]:
        """The request's verifier failed it with `error`: go on on a spare (re-raising
        `error` when none may take it), opened on the history. Yields its waits."""
        if not isinstance(error, VERIFIER_MOVES):
            raise error
        self.replace(gen, "verifier", error)
        # A consumer that leaves meanwhile must find the spare's session open, or the close
        # would miss it (`finishing`).
        yield from finishing(self.open_verifier(gen, resumed=True))

    def replace(self, gen: Generation, side: str, error: Exception) -> None:
        """Pin a spare of `side` in place of the replica that raised `error`; re-raise it when
        there is none, or this request has failed over too often. A lost drafter leaves the
        request to the target alone rather than failing it. A request out of time does not
        fail over (its replica may have dropped the session for that very reason)."""
        gen.check_deadline()
        if side == "drafter" and not isinstance(error, LOST):
            # A limit (a spare would be as full), a refusal or a fault of the drafter's own:
            # drop the drafter, go on with the target alone.
            cause = error.status.lower() if isinstance(error, TandemError) else "internal"
            logger.log(
                logging.INFO if isinstance(error, ResourceExhaustedError) else logging.WARNING,
                "request %s: drafting stops (%s): %s",
                gen.session_id,
                cause,
                error,
            )
            self._drafter_degraded(cause)
            run(gen.drafter.close())
            gen.drafter.drop(gen.committed)
            return
        failed_id = gen.verifier_id if side == "verifier" else gen.drafter.replica_id
        full = isinstance(error, ResourceExhaustedError)
        (gen.full if full else gen.failed).add(failed_id)
        logger.log(
            logging.INFO if full else logging.WARNING,
            "request %s: %s %s %s: %s",
            gen.session_id,
            side,
            failed_id,
            "had no room" if full else "failed",
            error,
        )
        failed_port = gen.verifier if side == "verifier" else gen.drafter.port
        if failed_port is not None and not isinstance(error, SessionNotFoundError):
            # It may only have been slow or cut off: free the session it may still hold now
            # rather than at its idle TTL, without holding up the request.
            Started(closed_quietly(side, failed_port, gen.session_id))  # sent, not awaited
        spare = None
        if len(gen.failed) + len(gen.full) <= MAX_FAILOVERS:
            # A replica lost this request is never tried again; one that was full only when
            # the request looks for room again.
            excluded = gen.failed | gen.full if full else gen.failed
            spare = self._replicas.spare(side, frozenset(excluded), deadline=gen.request.deadline)
        if spare is not None:
            gen.releases.append(spare.release)
        if side == "verifier":
            if spare is None:
                raise error
            gen.verifier, gen.verifier_id = spare.port, spare.replica_id
            gen.restart_verifier()
            return
        if spare is None:
            gen.drafter.drop(gen.committed)  # on with the target alone (and prompt lookup)
            return
        gen.stats.drafters.append(spare.replica_id)
        request = gen.request
        gen.drafter.move_to(
            spare.port,
            spare.replica_id,
            gen.committed,
            lambda port: port.open_session(
                gen.session_id,
                list(gen.history),
                request.sampling,
                request.seed,
                max_new_tokens=gen.remaining,
                constraint=gen.constraint,
            ),
        )
