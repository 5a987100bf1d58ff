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
  engine) for its `Progress`: a count (engine steps plus frames sent, both only ever growing)
  and how long the step running now has run. Unanswered within `PROBE_TIMEOUT_S`: dead
  (unreachable), fail over. The count past that of a probe taken before the window began, or
  a step running for less than `HUNG_STEP_S` (one long step: a slow device, a long prefill):
  busy. Otherwise: dead (stalled), fail over. A replica with no probe from before the window
  is busy once it answers (the next window compares against this probe).

So a dead process is found when its stream breaks, an unreachable one one probe after its
window, a hung one within two windows when held between steps and after `HUNG_STEP_S` when
stuck inside one; a busy one is never failed, however long its steps.
Thread-safe: probes complete on gRPC's threads. No I/O of its own (`probe` does it).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """What a liveness probe reads off a replica."""

    count: int
    """Engine steps plus frames sent since start (only ever grows)."""
    step_running_s: float = 0.0
    """How long the step running now has run (0: none is running)."""


PROBE_TIMEOUT_S = 10.0
"""How long a liveness probe may take before the replica counts as unreachable."""
HUNG_STEP_S = 300.0
"""How long one engine step may run before the replica counts as hung inside it: far past any
real forward pass (a long prefill on a slow device takes seconds)."""
SAMPLES_KEPT = 32
"""Probe answers kept (time, progress): enough to find one from before any window waited on."""


class Liveness:
    """One replica's busy-or-dead test (see the module doc); shared by every request's view."""

    def __init__(
        self,
        heard_at: Callable[[], float],
        probe: Callable[[], Future[Progress]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`heard_at()`: when the replica's frame stream last carried anything (a `clock`
        instant); `probe()`: a future of its `Progress`, failed when it did not answer."""
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

    def _judge(self, probe: Future[Progress], since: float) -> bool:
        try:
            progress = probe.result()
        except Exception:
            return False  # unanswered: unreachable
        if self._heard_at() > since:
            return True
        count = progress.count
        with self._lock:
            before = bisect.bisect_right(self._times, since)
            baseline = self._counts[before - 1] if before else None
            self._times.append(self._clock())
            self._counts.append(count)
            del self._times[:-SAMPLES_KEPT], self._counts[:-SAMPLES_KEPT]
        if 0 < progress.step_running_s < HUNG_STEP_S:
            return True  # one long step, still running
        return baseline is None or count > baseline
