"""The scheduler's gather decision, driven directly on a fake clock (no engine thread)."""

from __future__ import annotations

from cluster.runtime.limits import GATHER_SHARE
from cluster.runtime.scheduler import MAX_GATHER_S, Scheduler

STEP_S = 0.0064  # a GPU-like decode step: waiting for a session due within half of it pays


def test_a_step_waits_only_for_sessions_due_within_its_window() -> None:
    now = [10.0]
    scheduler = Scheduler(clock=lambda: now[0])
    # (return time, finished this long ago): what each session's record says.
    sessions = {
        "due-soon": (0.002, 0.001),  # back in 1 ms: waited for
        "due-later": (0.0045, 0.0005),  # back in 4 ms, beyond half a step: not
        "overdue": (0.001, 0.006),  # 5 ms late, more than a window: not
        "slow": (0.010, 0.0095),  # returns slower than a step (drafting first): never
        "never-back": (None, 0.0),  # no return time measured yet: not
    }
    for key, (return_s, ago_s) in sessions.items():
        scheduler.finished_at[key] = now[0] - ago_s
        if return_s is not None:
            scheduler.return_s[key] = return_s
    expected, window_s = scheduler.to_gather({}, STEP_S)
    assert window_s == min(MAX_GATHER_S, GATHER_SHARE * STEP_S)
    assert expected == {"due-soon"}
    now[0] += 0.003  # now "due-later" is due within the window too
    assert scheduler.to_gather({}, STEP_S)[0] == {"due-soon", "due-later"}


def test_a_gather_share_of_zero_never_waits() -> None:
    now = [10.0]
    scheduler = Scheduler(clock=lambda: now[0], gather_share=0.0)
    scheduler.finished_at["due-soon"] = now[0] - 0.001
    scheduler.return_s["due-soon"] = 0.002
    assert scheduler.to_gather({}, STEP_S) == (set(), 0.0)
    scheduler.gather_share = GATHER_SHARE
    assert scheduler.to_gather({}, STEP_S)[0] == {"due-soon"}
