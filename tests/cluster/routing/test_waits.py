"""Work that yields its waits: both drivers, work begun early, and cleanup that must finish."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from typing import Any

import pytest

from cluster.routing.waits import (
    Started,
    Wait,
    Waits,
    answer,
    blocking,
    drive,
    finishing,
    returning,
    run,
)


def later(value: Any, delay_s: float = 0.01) -> Future[Any]:
    future: Future[Any] = Future()
    threading.Timer(delay_s, future.set_result, (value,)).start()
    return future


def adder(a: int, b: int) -> Waits[int]:
    x = yield from answer(later(a))
    y = yield from answer(later(b))
    return x + y


def counting(n: int, log: list[str]) -> Any:
    try:
        for i in range(n):
            value = yield from adder(i, 1)
            yield value
    finally:
        log.append("closed")


def test_run_and_blocking_resume_each_wait_on_this_thread() -> None:
    assert run(adder(2, 3)) == 5
    assert run(returning(7)) == 7
    log: list[str] = []
    assert list(blocking(counting(3, log))) == [1, 2, 3]
    assert log == ["closed"]


def test_drive_runs_many_streams_on_one_loop() -> None:
    logs: list[list[str]] = [[] for _ in range(50)]
    resumed_on: set[str] = set()

    def recorded(steps: Any) -> Any:
        """`work`, noting the thread it is resumed on at each wait."""
        try:
            item = next(steps)
            while True:
                resumed_on.add(threading.current_thread().name)
                sent = yield item
                item = steps.send(sent)
        except StopIteration as stop:
            return stop.value
        finally:
            steps.close()

    async def main() -> list[list[int]]:
        async def collect(log: list[str]) -> list[int]:
            return [value async for value in drive(recorded(counting(4, log)))]

        return await asyncio.gather(*(collect(log) for log in logs))

    assert asyncio.run(main()) == [[1, 2, 3, 4]] * 50
    assert all(log == ["closed"] for log in logs)
    # Every step of the 50 streams ran on the loop's one thread (this one, under
    # asyncio.run): the driver started no thread of its own per stream. (The futures' timers
    # are the test's.)
    assert resumed_on == {threading.current_thread().name}


def test_a_wait_that_times_out_leaves_the_decision_to_the_step() -> None:
    never: Future[int] = Future()
    with pytest.raises(TimeoutError):
        run(answer(never, timeout_s=0.01))

    async def main() -> None:
        with pytest.raises(TimeoutError):
            async for _ in drive(answer(never, timeout_s=0.01)):
                pass

    asyncio.run(main())
    assert not never.done()  # the driver never cancels the step's future


def test_started_sends_at_once_and_finishes_later() -> None:
    sent: list[str] = []

    def request() -> Waits[str]:
        sent.append("sent")
        return (yield from answer(later("answer")))

    begun = Started(request())
    assert sent == ["sent"]  # before anything waits for it
    assert run(begun.finish()) == "answer"
    assert begun.done() and begun.finished_at is not None
    failed = Started(_raises())
    assert failed.done()
    with pytest.raises(ValueError, match="at once"):
        run(failed.finish())


def _raises() -> Waits[int]:
    raise ValueError("at once")
    yield  # pragma: no cover


def test_cleanup_closed_at_a_wait_finishes_blocking() -> None:
    closed: list[bool] = []

    def cleanup() -> Waits[None]:
        closed.append((yield from answer(later(True, 0.05))))

    def stream() -> Any:
        try:
            yield "chunk"
        finally:
            pass
        yield from finishing(cleanup())

    steps = stream()
    assert next(steps) == "chunk"
    assert isinstance(next(steps), Wait)  # the cleanup waits...
    steps.close()  # ...and its consumer leaves: it finishes on this thread
    assert closed == [True]


def test_drive_can_start_each_stream_on_an_executor() -> None:
    threads_seen: list[str] = []

    def stream() -> Any:
        threads_seen.append(threading.current_thread().name)  # the set-up, up to the first wait
        yield from adder(1, 1)
        threads_seen.append(threading.current_thread().name)
        yield "chunk"

    async def main() -> list[str]:
        with ThreadPoolExecutor(1, thread_name_prefix="opening") as pool:
            return [item async for item in drive(stream(), start_on=pool)]

    assert asyncio.run(main()) == ["chunk"]
    assert threads_seen[0].startswith("opening")
    assert threads_seen[1] == threading.main_thread().name  # the rest ran on the loop


def test_a_stream_cancelled_while_it_starts_is_closed_once_its_first_step_ends() -> None:
    release = threading.Event()
    closed: list[bool] = []

    def stream() -> Any:
        try:
            release.wait(5)
            yield "chunk"
        finally:
            closed.append(True)

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            steps = drive(stream(), start_on=pool)
            first = asyncio.ensure_future(anext(steps))
            await asyncio.sleep(0.01)  # its first step is running on the pool
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert closed == []  # it cannot be closed while it runs
            release.set()

    asyncio.run(main())
    assert closed == [True]
