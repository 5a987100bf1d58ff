"""BusyLock: counts the time the lock is held, not the time spent waiting for it."""

from __future__ import annotations

import threading
import time

from verifier.runtime.session import BusyLock

HOLD_S = 0.2


def test_busy_time_is_time_held_not_time_waited() -> None:
    lock = BusyLock()
    held = threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            time.sleep(HOLD_S)

    holder = threading.Thread(target=hold)
    started = time.perf_counter()  # the lock's own clock
    holder.start()
    held.wait()
    with lock:  # waits about HOLD_S for the holder, then holds for no time at all
        pass
    ended = time.perf_counter()
    holder.join()
    # sleep() sleeps at least HOLD_S, so the lower bound is exact. The two holds are disjoint
    # and lie inside [started, ended], so their sum cannot exceed it; counting the wait too
    # would add the span both threads spent in the lock at once (nearly HOLD_S) on top.
    assert HOLD_S <= lock.busy_s <= ended - started
