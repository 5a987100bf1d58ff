"""`stream_on_loop`: a Tandem stream's steps run on the event loop, pending items merged.

Both faces of the router (gRPC and HTTP, on Serve's proxies and on the routers' own servers)
read a stream through it, and a cancelled call (the client went away) closes it, which is what
frees the request's sessions on both replicas. The generators here stand for a Tandem stream:
their `finally` is the close. No timing is assumed beyond short sleeps that let the loop run: a
slow reader is one that reads only once the producer has produced what the test needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from concurrent.futures import Future

import pytest

from cluster.api.response import ApiChunk, Usage, coalesce
from cluster.routing.request import FinishReason, SpeculationStats
from cluster.routing.waits import Wait
from cluster.serve.calls import stream_on_loop


def unmerged(items: list[int]) -> list[int]:
    return items


def as_tuple(items: list[int]) -> list[tuple[int, ...]]:
    return [tuple(items)]


async def cancel(task: asyncio.Future[int]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_an_error_comes_after_the_items_before_it() -> None:
    answer: Future[int] = Future()

    def failing() -> Generator[int | Wait, None, None]:
        yield 1
        yield 2
        yield Wait(answer)
        raise ValueError("the stream failed")

    async def read_after_the_failure() -> list[tuple[int, ...]]:
        chunks = stream_on_loop(failing(), as_tuple)
        read = [await anext(chunks)]
        answer.set_result(0)
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="the stream failed"):
            while True:
                read.append(await anext(chunks))
        return read

    read = asyncio.run(read_after_the_failure())
    assert [item for merged in read for item in merged] == [1, 2]


NUM_CHUNKS = 20


def test_a_slow_reader_gets_fewer_merged_chunks_with_the_same_content() -> None:
    """The reader takes its first chunk, then reads again only once every chunk has been
    produced: whatever was pending comes as one chunk, with the same content."""
    released: Future[int] = Future()
    stats = SpeculationStats(num_drafted=3, num_accepted=2, num_verify_passes=4)
    last = ApiChunk("r", (NUM_CHUNKS,), "end", FinishReason.STOP, Usage(5, NUM_CHUNKS + 1), stats)

    def chunks() -> Generator[ApiChunk | Wait, None, None]:
        yield ApiChunk("r", (0,), "<0>")
        yield Wait(released)
        for n in range(1, NUM_CHUNKS):
            yield ApiChunk("r", (n,), f"<{n}>")
        yield last

    async def read_slowly() -> list[ApiChunk]:
        merged = stream_on_loop(chunks(), coalesce)
        received = [await anext(merged)]
        released.set_result(0)
        await asyncio.sleep(0.05)
        received.extend([chunk async for chunk in merged])
        return received

    received = asyncio.run(read_slowly())
    assert len(received) == 2 < NUM_CHUNKS + 1
    assert tuple(t for chunk in received for t in chunk.tokens) == tuple(range(NUM_CHUNKS + 1))
    assert (
        "".join(chunk.text for chunk in received)
        == "".join(f"<{n}>" for n in range(NUM_CHUNKS)) + "end"
    )
    assert [chunk.finish_reason for chunk in received] == [None, FinishReason.STOP]
    assert (received[-1].usage, received[-1].stats) == (last.usage, stats)


# --- steps on the loop ------------------------------------------------------------------------


def stepped(answers: list[Future[int]], closed: list[bool]) -> Generator[int | Wait, None, None]:
    """Waits yielding each answer once it is in (their waits need no thread)."""
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
