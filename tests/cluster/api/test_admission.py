"""The router's bounded queue: refuses at once when full, lets requests in by weighted fair
share, and gives up on a request whose deadline passes while it waits."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.api.admission import Admission
from cluster.api.tenants import QuotaExceededError
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError


def wait_for(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_full_queue_refuses_at_once_with_when_to_retry() -> None:
    admission = Admission(max_running=1, max_queued=1)
    admission.enter("a")
    waiting = threading.Thread(target=admission.enter, args=("a",))
    waiting.start()
    wait_for(lambda: admission.queued == 1)
    with pytest.raises(QuotaExceededError, match="at capacity") as error:
        admission.enter("b")
    assert error.value.status == "RESOURCE_EXHAUSTED" and error.value.retry_after_s > 0
    admission.leave("a")  # the queued one runs now
    waiting.join(timeout=10)
    assert not waiting.is_alive() and admission.running == 1 and admission.queued == 0


def test_waiting_requests_go_in_by_fair_share() -> None:
    admission = Admission(max_running=2, max_queued=10)
    admission.enter("other")
    admission.enter("other")
    order: list[str] = []

    def request(tenant: str) -> None:
        admission.enter(tenant)
        order.append(tenant)

    # A burst of three from "busy" queues first, then one request from "light".
    threads = [threading.Thread(target=request, args=(t,)) for t in ["busy"] * 3 + ["light"]]
    for queued, thread in enumerate(threads, start=1):
        thread.start()
        wait_for(lambda n=queued: admission.queued == n)  # type: ignore[misc]
    admission.leave("other")
    wait_for(lambda: len(order) == 1)
    assert order == ["busy"]  # nobody of either runs: the longest waiting goes first
    admission.leave("other")
    wait_for(lambda: len(order) == 2)
    assert order == ["busy", "light"]  # "busy" runs one, "light" none: light jumps the burst
    admission.leave("busy")
    admission.leave("light")
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["busy", "light", "busy", "busy"]


def test_weight_buys_a_larger_share() -> None:
    admission = Admission(max_running=3, max_queued=10)
    for _ in range(2):
        admission.enter("big", 2.0)
    admission.enter("small", 1.0)
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda t=t, w=w: (admission.enter(t, w), got.append(t)))
        for t, w in [("small", 1.0), ("big", 2.0)]
    ]
    for queued, thread in enumerate(threads, start=1):
        thread.start()
        wait_for(lambda n=queued: admission.queued == n)  # type: ignore[misc]
    # big: 2 running / weight 2 = 1.0; small: 1 / 1 = 1.0 -> tie, the longest waiting (small).
    admission.leave("big")  # big: 1 / 2 = 0.5 < small's 1.0 -> big goes first
    wait_for(lambda: len(got) == 1)
    assert got == ["big"]
    admission.leave("small")
    for thread in threads:
        thread.join(timeout=10)
    assert got == ["big", "small"]


def test_a_deadline_passing_in_the_queue_is_deadline_exceeded() -> None:
    admission = Admission(max_running=1, max_queued=5)
    admission.enter("a")
    with pytest.raises(DeadlineExceededError, match="waited in the router's queue"):
        admission.enter("b", deadline=time.monotonic() + 0.2)
    assert admission.queued == 0
    admission.leave("a")
    admission.enter("b", deadline=time.monotonic() + 10)  # room again: in at once
    assert admission.running == 1


def test_limits_are_validated() -> None:
    with pytest.raises(InvalidArgumentError):
        Admission(max_running=0, max_queued=1)
    with pytest.raises(InvalidArgumentError):
        Admission(max_running=1, max_queued=-1)
