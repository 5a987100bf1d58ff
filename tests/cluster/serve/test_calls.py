"""`iterate_in_thread`: a blocking Tandem stream bridged to the event loop, step by step.

Both faces of the router ingress (gRPC and HTTP) read a stream through it, and a cancelled
call (the client went away) closes it, which is what frees the request's sessions on both
replicas. The generator here stands for a Tandem stream: its `finally` is the close. A step
can be cancelled while it runs (the close must wait for it: a running generator cannot be
closed) or while it still waits for a thread of the pool (it never runs; the close must not
wait on it as if it had failed). Each test keeps its own reference to the generator, so only
an explicit close, never garbage collection, can run its `finally`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.serve.calls import iterate_in_thread
from tests.polling import wait_until


class Stream:
    """A blocking stream of three items that records how it ended; `hold` blocks its second
    step until released."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.closed = threading.Event()
        self.running_second = threading.Event()
        self._hold = hold

    def items(self) -> Generator[int, None, None]:
        try:
            yield 1
            self.running_second.set()
            if self._hold is not None:
                self._hold.wait()
            yield 2
            yield 3
        finally:
            self.closed.set()


@pytest.fixture
def threads() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="step")
    yield pool
    pool.shutdown(wait=True)


async def cancel(task: asyncio.Task[int]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_stream_read_to_its_end_is_closed(threads: ThreadPoolExecutor) -> None:
    stream = Stream()
    items = stream.items()

    async def read() -> list[int]:
        return [item async for item in iterate_in_thread(items, threads)]

    assert asyncio.run(read()) == [1, 2, 3]
    wait_until(stream.closed.is_set, what="the stream closed")


def test_a_step_cancelled_while_it_runs_closes_the_stream_once_it_ends(
    threads: ThreadPoolExecutor,
) -> None:
    hold = threading.Event()
    stream = Stream(hold)
    items = stream.items()

    async def leave_during_the_second_step() -> None:
        chunks = iterate_in_thread(items, threads)
        assert await anext(chunks) == 1
        second = asyncio.ensure_future(anext(chunks))
        await asyncio.to_thread(stream.running_second.wait)
        await cancel(second)
        assert not stream.closed.is_set()  # it is still running: it cannot be closed yet
        hold.set()

    asyncio.run(leave_during_the_second_step())
    wait_until(stream.closed.is_set, what="the stream closed after its step")


def test_a_step_cancelled_before_a_thread_took_it_still_closes_the_stream(
    threads: ThreadPoolExecutor,
) -> None:
    """The pool's one thread is busy, so the second step is still queued when the call is
    cancelled: cancelling it succeeds and it never runs, yet the stream must be closed."""
    stream = Stream()
    items = stream.items()
    busy = threading.Event()

    async def leave_while_the_step_waits() -> None:
        chunks = iterate_in_thread(items, threads)
        assert await anext(chunks) == 1
        threads.submit(busy.wait)
        second = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the step is submitted, behind `busy`
        await cancel(second)
        busy.set()

    asyncio.run(leave_while_the_step_waits())
    wait_until(stream.closed.is_set, what="the stream closed")
    assert not stream.running_second.is_set()  # the cancelled step never ran
