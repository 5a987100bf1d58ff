"""A silent verifier: when a request's verifier has reported nothing for too long, and what
then.

Its client's `timeout_s` is a window of allowed silence: a running session owes a report each
step, a lockstep one only for a block posted to it. Once a whole window passes in silence, the
verifier's liveness decides (`cluster.routing.liveness`, where the client has one): busy, it
gets another window; dead or stalled, its error goes among the session's reports, and the
round that reads them fails it over (`Failover.move_verifier`).

Pure bookkeeping over `Generation` (`heard_at`, `silent_from`, `liveness`), no I/O of its own:
the router's loop (`cluster.routing.rounds`) waits until `heard_by` and calls `check_silence`
after every wait.
"""

from __future__ import annotations

from cluster.routing.generation import Generation
from cluster.routing.liveness import PROBE_TIMEOUT_S
from cluster.runtime.errors import ReplicaUnavailableError


def heard_by(gen: Generation) -> float | None:
    """When the verifier's silence means it is lost (None: never; a session that does not
    run owes a report only for a block posted to it)."""
    timeout_s = getattr(gen.verifier, "timeout_s", None)
    if timeout_s is None or (gen.advance is None and not gen.posts):
        return None
    return max(gen.heard_at, gen.silent_from) + timeout_s


def check_silence(gen: Generation) -> None:
    """Once the verifier has been silent a whole window, its liveness decides
    (`cluster.routing.liveness`, where the client has one): busy, a new window; dead or
    stalled, its error among its reports (a failover follows)."""
    if gen.events.waiting():
        gen.liveness = None  # it reported: nothing to decide
        return
    until = heard_by(gen)
    if gen.liveness is None and (until is None or gen.now() < until):
        return
    if gen.liveness is None:
        progressing = getattr(gen.verifier, "progressing", None)
        if progressing is not None and until is not None:
            window_s = until - max(gen.heard_at, gen.silent_from)
            gen.liveness = progressing(until - 2 * window_s)  # the last two windows
            gen.liveness_until = gen.now() + PROBE_TIMEOUT_S + 1.0
    check = gen.liveness
    if check is not None and not check.done() and gen.now() < gen.liveness_until:
        return  # the next wait takes its answer
    gen.liveness = None
    if check is not None and check.done() and check.result():
        gen.silent_from = gen.now()  # busy: it has another window
        return
    silence_s = gen.now() - gen.heard_at
    gen.events.report(
        ReplicaUnavailableError(
            f"the {gen.verifier_id} reported nothing for {silence_s:.1f} s, and made no "
            "progress (nothing heard from it, its engine took no step and runs none)"
        )
    )
