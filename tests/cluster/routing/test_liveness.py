"""A replica that has not answered in time is busy or dead by its own progress
(`cluster.routing.liveness`): heard from since the window began, its progress count past a
probe from before it, or one step still running short of a hung step's time. Pure: the
clock, what was heard and the probes' answers are fed."""

from __future__ import annotations

from concurrent.futures import Future

from cluster.routing.liveness import HUNG_STEP_S, Liveness, Progress


class Replica:
    """What a `Liveness` reads: when a frame was last heard, and probes answered by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heard = -1.0
        self.probes: list[Future[Progress]] = []

    def clock(self) -> float:
        return self.now

    def heard_at(self) -> float:
        return self.heard

    def probe(self) -> Future[Progress]:
        self.probes.append(Future())
        return self.probes[-1]

    def liveness(self) -> Liveness:
        return Liveness(self.heard_at, self.probe, self.clock)


def test_heard_from_since_the_window_began_is_busy_without_a_probe() -> None:
    replica = Replica()
    replica.heard = 5.0
    assert replica.liveness().check(since=4.0).result(timeout=0) is True
    assert not replica.probes


def test_an_unanswered_probe_is_dead() -> None:
    replica = Replica()
    check = replica.liveness().check(since=0.0)
    assert not check.done()
    replica.probes[0].set_exception(TimeoutError("no answer"))
    assert check.result(timeout=0) is False


def test_a_stalled_engine_is_dead_a_stepping_one_busy() -> None:
    replica = Replica()
    liveness = replica.liveness()
    replica.now = 60.0  # the first window: no probe from before it, so an answer is enough
    first = liveness.check(since=0.0)
    replica.probes[-1].set_result(Progress(100))
    assert first.result(timeout=0) is True
    replica.now = 120.0  # the next window: compared with the probe taken at 60
    stalled = liveness.check(since=60.0)
    replica.probes[-1].set_result(Progress(100))
    assert stalled.result(timeout=0) is False
    replica.now = 180.0
    stepping = liveness.check(since=120.0)
    replica.probes[-1].set_result(Progress(101))
    assert stepping.result(timeout=0) is True


def test_requests_checking_together_share_the_baseline_from_before_their_window() -> None:
    # Two requests' windows end together: the second's probe must not be judged against the
    # first's (taken a moment before, inside the window).
    replica = Replica()
    liveness = replica.liveness()
    replica.now = 10.0
    liveness.check(since=0.0)
    replica.probes[-1].set_result(Progress(50))
    replica.now = 70.0
    checks = [liveness.check(since=10.5) for _ in range(2)]
    replica.probes[0 - 2].set_result(Progress(80))
    replica.now = 70.1
    replica.probes[-1].set_result(Progress(80))
    assert [check.result(timeout=0) for check in checks] == [True, True]


def test_one_step_longer_than_the_windows_is_busy_until_it_looks_hung() -> None:
    # Steps three windows long (a slow device): no step ends within two windows, but the one
    # running is young, so the replica is busy; the same step stuck past HUNG_STEP_S is not.
    replica = Replica()
    liveness = replica.liveness()
    replica.now = 1.0
    liveness.check(since=0.0)
    replica.probes[-1].set_result(Progress(7, step_running_s=0.5))
    replica.now = 2.0
    long_step = liveness.check(since=1.0)
    replica.probes[-1].set_result(Progress(7, step_running_s=1.5))
    assert long_step.result(timeout=0) is True
    replica.now = 3.0
    between_steps = liveness.check(since=2.0)
    replica.probes[-1].set_result(Progress(7, step_running_s=0.0))
    assert between_steps.result(timeout=0) is False
    replica.now = 4.0
    hung = liveness.check(since=3.0)
    replica.probes[-1].set_result(Progress(7, step_running_s=HUNG_STEP_S))
    assert hung.result(timeout=0) is False
