"""Waiting for a state instead of sleeping: `wait_until` polls a predicate until it holds.

A test that must act once something else has happened (a request is queued, a loop has run,
a process is gone) polls for that state: a fixed sleep is either too short on a loaded machine
(a flaky test) or needlessly long everywhere. `timeout_s` only bounds a test that would
otherwise hang; it is never the thing asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.01


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    """Return once `predicate()` is truthy; fail the test if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(POLL_S)
