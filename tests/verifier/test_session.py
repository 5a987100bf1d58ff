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
    holder.start()
    held.wait()
    with lock:  # waits about HOLD_S for the holder, then holds for no time at all
        pass
    holder.join()
    # sleep() sleeps at least HOLD_S, so the lower bound is exact; the upper bound only needs
    # to stay below the two holds that counting the wait would give, with room for a late wake.
    assert HOLD_S <= lock.busy_s < 1.5 * HOLD_S
