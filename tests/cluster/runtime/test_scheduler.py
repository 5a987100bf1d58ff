"""The scheduler driven directly on a fake clock (no engine thread): the tasks it owns (each
key's active and queued tasks, the keyless queue, the running keys' makers) and its gather
decision."""

from __future__ import annotations

from cluster.runtime.block_runner import SequenceWork
from cluster.runtime.limits import GATHER_SHARE
from cluster.runtime.scheduler import MAX_GATHER_S, Scheduler
from cluster.runtime.task import Forward, Running, Task
from tests.cluster.runtime.fake_runner import RecordingRunner

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
    expected, window_s = scheduler.to_gather(STEP_S)
    assert window_s == min(MAX_GATHER_S, GATHER_SHARE * STEP_S)
    assert expected == {"due-soon"}
    now[0] += 0.003  # now "due-later" is due within the window too
    assert scheduler.to_gather(STEP_S)[0] == {"due-soon", "due-later"}


def test_a_gather_share_of_zero_never_waits() -> None:
    now = [10.0]
    scheduler = Scheduler(clock=lambda: now[0], gather_share=0.0)
    scheduler.finished_at["due-soon"] = now[0] - 0.001
    scheduler.return_s["due-soon"] = 0.002
    assert scheduler.to_gather(STEP_S) == (set(), 0.0)
    scheduler.gather_share = GATHER_SHARE
    assert scheduler.to_gather(STEP_S)[0] == {"due-soon"}


def idle() -> Task[None]:
    return None
    yield  # a generator that yields nothing


def submitted(key: str | None, at: float = 0.0, *, closes: bool = False) -> Running:
    return Running(idle(), key, None, at, closes=closes)


def test_a_keys_tasks_queue_behind_its_active_one_and_start_in_submission_order() -> None:
    scheduler = Scheduler(clock=lambda: 0.0)
    first, second, third = submitted("a"), submitted("a"), submitted("a")
    other, keyless = submitted("b"), submitted(None)
    assert scheduler.admit(first) is first  # the key's first: the caller starts it
    assert scheduler.admit(second) is None and scheduler.admit(third) is None
    assert scheduler.admit(other) is other
    assert scheduler.admit(keyless) is None
    assert scheduler.active_keys() == {"a", "b"} and scheduler.num_queued == 2
    assert dict(scheduler.active) == {"a": first, "b": other}
    assert scheduler.next_keyless() is keyless and scheduler.next_keyless() is None
    # Each finished task hands its key's next one over, now active.
    assert scheduler.finished(first) is second and scheduler.active["a"] is second
    assert scheduler.num_queued == 1
    assert scheduler.finished(second) is third
    assert scheduler.finished(third) is None and scheduler.finished(other) is None
    assert scheduler.active_keys() == frozenset() and scheduler.num_queued == 0
    assert not scheduler.has_work()
    assert set(scheduler.finished_at) == {"a", "b"}  # expected back, for their return times


def test_a_closing_task_is_not_expected_back_and_a_queued_one_is_not_yet_idle() -> None:
    now = [5.0]
    scheduler = Scheduler(clock=lambda: now[0])
    opening, closing = submitted("s", 5.0), submitted("s", 5.0, closes=True)
    scheduler.admit(opening)
    scheduler.admit(closing)
    assert scheduler.finished(opening) is closing
    assert "s" not in scheduler.finished_at  # its next task was already waiting
    assert scheduler.finished(closing) is None
    assert "s" not in scheduler.finished_at and "s" not in scheduler.return_s


def test_a_running_key_gets_a_next_task_only_when_it_has_none() -> None:
    scheduler = Scheduler(clock=lambda: 0.0)
    made: list[int] = []

    def make() -> Task[None] | None:
        if len(made) == 2:
            return None  # nothing more to do
        made.append(1)
        return idle()

    scheduler.keep_running("r", make)
    assert scheduler.is_running("r") and scheduler.num_running == 1
    step = scheduler.next_running("r", 1.0)
    assert step is not None and step.future is None and step.waited
    assert scheduler.active["r"] is step
    assert scheduler.next_running("r", 1.0) is None and len(made) == 1  # it has one active
    called = submitted("r")
    assert scheduler.admit(called) is None  # a caller's task queues behind the step
    assert scheduler.finished(step) is called
    assert scheduler.next_running("r", 2.0) is None and len(made) == 1  # the caller's runs
    assert scheduler.finished(called) is None
    assert scheduler.next_running("r", 3.0) is not None and len(made) == 2
    scheduler.finished(scheduler.active["r"])
    assert scheduler.next_running("r", 4.0) is None  # the maker had nothing more
    assert not scheduler.is_running("r") and scheduler.running_keys() == []


def test_drain_hands_back_every_task_and_forgets_the_running_keys() -> None:
    scheduler = Scheduler(clock=lambda: 0.0)
    tasks = [submitted("a"), submitted("a"), submitted(None), submitted("b")]
    for running in tasks:
        scheduler.admit(running)
    scheduler.keep_running("b", idle)
    assert set(scheduler.drain()) == set(tasks)
    assert scheduler.active_keys() == frozenset() and scheduler.num_queued == 0
    assert scheduler.next_keyless() is None and scheduler.num_running == 0


def wait_on_forward(running: Running, since: float) -> None:
    running.waiting = Forward(SequenceWork(str(running.key), (1,), (0,)))
    running.ready_since = since


def test_a_step_packs_only_the_active_tasks_waiting_on_a_forward() -> None:
    scheduler = Scheduler(64, 8, clock=lambda: 0.0)
    old, new, idle_key, behind = (
        submitted("old"),
        submitted("new"),
        submitted("idle"),
        submitted("old"),
    )
    for running in (old, new, idle_key, behind):
        scheduler.admit(running)
    wait_on_forward(new, 2.0)
    wait_on_forward(old, 1.0)
    wait_on_forward(behind, 0.0)  # queued behind "old": not the key's to run yet
    batch, chunks = scheduler.pack(RecordingRunner(), lambda running, blocks: None)
    assert batch == [old, new]  # oldest first; "idle" waits on nothing
    assert [c.seq_id for c in chunks] == ["old", "new"]
