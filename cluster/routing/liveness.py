"""Whether a replica that has not answered in time is busy or dead: by its own progress, not by
one call's time.

A call to a replica (or a running session's next report) can take longer than the router's
`replica_rpc_timeout_s` on a replica that is alive and working: long prompts queued ahead of
it, many sessions per step. Failing it over then loses the work done and piles the load on
another replica. So when a wait's window passes, the router asks `Liveness.check(since)`, where
`since` is when the window before it began (progress within the last two windows counts: a
single step longer than a window shows none within it):

- something was heard on the replica's frame stream since then (it answered other entries):
  busy, keep waiting;
- else the replica is probed (its `Stats` call, answered by its server's threads, not by its
  engine) for its progress count (engine steps plus frames sent, both only ever growing):
  unanswered within `PROBE_TIMEOUT_S`, or not past the count of a probe taken before the
  window began: dead (stalled), fail over; past it: busy. A replica with no probe from before
  the window is busy once it answers (the next window compares against this probe).

So a dead process is found when its stream breaks, an unreachable one one probe after its
window, a hung one (connected, no step taken) within two windows; a busy one is never failed.
Thread-safe: probes complete on gRPC's threads. No I/O of its own (`probe` does it).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

PROBE_TIMEOUT_S = 10.0
"""How long a liveness probe may take before the replica counts as unreachable."""
SAMPLES_KEPT = 32
"""Probe answers kept (time, progress): enough to find one from before any window waited on."""


class Liveness:
    """One replica's busy-or-dead test (see the module doc); shared by every request's view."""

    def __init__(
        self,
        heard_at: Callable[[], float],
        probe: Callable[[], Future[int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`heard_at()`: when the replica's frame stream last carried anything (a `clock`
        instant); `probe()`: a future of its progress count, failed when it did not answer."""
        self._heard_at = heard_at
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._times: list[float] = []
        self._counts: list[int] = []

    def check(self, since: float) -> Future[bool]:
        """A future of whether the replica made progress since `since` (True: busy, keep
        waiting; False: dead or stalled)."""
        verdict: Future[bool] = Future()
        if self._heard_at() > since:
            verdict.set_result(True)
            return verdict
        probe = self._probe()
        probe.add_done_callback(lambda done: verdict.set_result(self._judge(done, since)))
        return verdict

    def _judge(self, probe: Future[int], since: float) -> bool:
        try:
            count = probe.result()
        except Exception:
            return False  # unanswered: unreachable
        if self._heard_at() > since:
            return True
        with self._lock:
            before = bisect.bisect_right(self._times, since)
            baseline = self._counts[before - 1] if before else None
            self._times.append(self._clock())
            self._counts.append(count)
            del self._times[:-SAMPLES_KEPT], self._counts[:-SAMPLES_KEPT]
        return baseline is None or count > baseline
