"""`stream_in_thread`: a blocking Tandem stream bridged to the event loop, pending items merged.

Both faces of the router ingress (gRPC and HTTP) read a stream through it, and a cancelled
call (the client went away) closes it, which is what frees the request's sessions on both
replicas. The generator here stands for a Tandem stream: its `finally` is the close. One thread
runs it to its end; the reader can leave while a step runs (the close must wait for it: a
running generator cannot be closed) or before the thread has started (it closes the generator
without a step). Each test keeps its own reference to the generator, so only an explicit close,
never garbage collection, can run its `finally`. No timing is assumed: a slow reader is one
that waits on an event the producer sets once it has produced what the test needs.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from cluster.api.response import ApiChunk, Usage, coalesce
from cluster.routing.request import FinishReason, SpeculationStats
from cluster.routing.waits import Wait
from cluster.serve.calls import stream_in_thread, stream_on_loop
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


def unmerged(items: list[int]) -> list[int]:
    return items


def as_tuple(items: list[int]) -> list[tuple[int, ...]]:
    return [tuple(items)]


@pytest.fixture
def threads() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="stream")
    yield pool
    pool.shutdown(wait=True)


async def cancel(task: asyncio.Future[int]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_stream_read_to_its_end_is_closed(threads: ThreadPoolExecutor) -> None:
    stream = Stream()
    items = stream.items()

    async def read() -> list[int]:
        return [item async for item in stream_in_thread(items, threads, unmerged)]

    assert asyncio.run(read()) == [1, 2, 3]
    wait_until(stream.closed.is_set, what="the stream closed")


def test_a_reader_that_leaves_during_a_step_closes_the_stream_once_it_ends(
    threads: ThreadPoolExecutor,
) -> None:
    hold = threading.Event()
    stream = Stream(hold)
    items = stream.items()

    async def leave_during_the_second_step() -> None:
        chunks = stream_in_thread(items, threads, unmerged)
        assert await anext(chunks) == 1
        second = asyncio.ensure_future(anext(chunks))
        await asyncio.to_thread(stream.running_second.wait)
        await cancel(second)
        assert not stream.closed.is_set()  # it is still running: it cannot be closed yet
        hold.set()

    asyncio.run(leave_during_the_second_step())
    wait_until(stream.closed.is_set, what="the stream closed after its step")


def test_a_reader_that_leaves_before_a_thread_took_the_stream_still_closes_it(
    threads: ThreadPoolExecutor,
) -> None:
    """The pool's one thread is busy, so the stream has not started when the call is
    cancelled: it never runs a step, yet it must be closed."""
    stream = Stream()
    items = stream.items()
    busy = threading.Event()

    async def leave_while_the_stream_waits() -> None:
        chunks = stream_in_thread(items, threads, unmerged)
        threads.submit(busy.wait)
        first = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the stream is submitted, behind `busy`
        await cancel(first)
        busy.set()

    asyncio.run(leave_while_the_stream_waits())
    wait_until(
        lambda: inspect.getgeneratorstate(items) == inspect.GEN_CLOSED, what="the stream closed"
    )
    assert not stream.running_second.is_set()


def test_an_error_comes_after_the_items_before_it(threads: ThreadPoolExecutor) -> None:
    failed = threading.Event()

    def failing() -> Generator[int, None, None]:
        yield 1
        yield 2
        failed.set()
        raise ValueError("the stream failed")

    async def read_after_the_failure() -> list[tuple[int, ...]]:
        chunks = stream_in_thread(failing(), threads, as_tuple)
        read = [await anext(chunks)]  # the stream starts with the first read
        await asyncio.to_thread(failed.wait)
        with pytest.raises(ValueError, match="the stream failed"):
            while True:
                read.append(await anext(chunks))
        return read

    read = asyncio.run(read_after_the_failure())
    assert [item for merged in read for item in merged] == [1, 2]


NUM_CHUNKS = 20


def test_a_slow_reader_gets_fewer_merged_chunks_with_the_same_content(
    threads: ThreadPoolExecutor,
) -> None:
    """The reader takes its first chunk, then waits until the producer has produced every
    chunk but the last: whatever was pending when it asks again comes as one chunk."""
    produced = threading.Event()
    stats = SpeculationStats(num_drafted=3, num_accepted=2, num_verify_passes=4)
    last = ApiChunk("r", (NUM_CHUNKS,), "end", FinishReason.STOP, Usage(5, NUM_CHUNKS + 1), stats)

    def chunks() -> Generator[ApiChunk, None, None]:
        for n in range(NUM_CHUNKS):
            yield ApiChunk("r", (n,), f"<{n}>")
        produced.set()
        yield last

    async def read_slowly() -> list[ApiChunk]:
        merged = stream_in_thread(chunks(), threads, coalesce)
        received = [await anext(merged)]
        await asyncio.to_thread(produced.wait)
        received.extend([chunk async for chunk in merged])
        return received

    received = asyncio.run(read_slowly())
    # At most: what was pending at the first read, all the rest but the last, the last.
    assert len(received) <= 3 < NUM_CHUNKS + 1
    assert tuple(t for chunk in received for t in chunk.tokens) == tuple(range(NUM_CHUNKS + 1))
    assert (
        "".join(chunk.text for chunk in received)
        == "".join(f"<{n}>" for n in range(NUM_CHUNKS)) + "end"
    )
    assert [chunk.finish_reason for chunk in received][-1] == FinishReason.STOP
    assert all(chunk.finish_reason is None for chunk in received[:-1])
    assert (received[-1].usage, received[-1].stats) == (last.usage, stats)


# --- steps on the loop ------------------------------------------------------------------------


def stepped(answers: list[Future[int]], closed: list[bool]) -> Generator[int | Wait, None, None]:
    """Steps yielding each answer once it is in (their waits need no thread)."""
    try:
        for future in answers:
            if not future.done():
                yield Wait(future)
            yield future.result()
    finally:
        closed.append(True)


def test_steps_on_the_loop_are_merged_for_a_lagging_reader_and_closed() -> None:
    answers: list[Future[int]] = [Future() for _ in range(4)]
    closed: list[bool] = []

    async def read() -> list[tuple[int, ...]]:
        chunks = stream_on_loop(stepped(answers, closed), as_tuple)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, answers[0].set_result, 1)
        first = await anext(chunks)
        for value, future in enumerate(answers[1:], 2):  # all in before the reader asks again
            future.set_result(value)
        await asyncio.sleep(0.05)
        rest = [item async for item in chunks]
        return [first, *rest]

    assert asyncio.run(read()) == [(1,), (2, 3, 4)]
    assert closed == [True]


def test_a_reader_that_leaves_closes_the_steps_on_the_loop() -> None:
    answers: list[Future[int]] = [Future() for _ in range(2)]
    answers[0].set_result(1)
    closed: list[bool] = []

    async def leave_while_it_waits() -> None:
        chunks = stream_on_loop(stepped(answers, closed), unmerged)
        assert await anext(chunks) == 1
        second = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0.01)  # the steps wait for an answer that never comes
        await cancel(second)
        await chunks.aclose()
        await asyncio.sleep(0)  # the producing task sees its cancellation

    asyncio.run(leave_while_it_waits())
    assert closed == [True]
    assert not answers[1].done()  # nothing waited on a thread for it
