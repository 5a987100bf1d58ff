"""What both faces of the router ingress share about a call: reading the deadline it states,
and running its blocking work off the event loop.

The gRPC face (`cluster.serve.ingress`) and the OpenAI-compatible HTTP face
(`cluster.serve.http`) both import this module and it imports neither, so the two faces never
import each other's helpers (the ingress builds the HTTP face; nothing imports back up).

- `deadline_of`: the deadline a caller states in `x-tandem-deadline-ms` (gRPC metadata or HTTP
  headers alike: pairs of name and value), as an instant of the local clock; the ingress's
  docstring says how it is honoured.
- `stream_on_loop` (`stream_merged`): a Tandem stream as waits (`cluster.routing.waits`) on the
  event loop, with what a lagging reader has pending merged. A task of the loop runs the stream,
  awaiting each wait, so no thread is held per request; each time the reader asks for the next
  item it gets everything pending merged by `merge` (`cluster.api.response.coalesce` for
  Tandem chunks: tokens and text concatenated, a finish reason ends a merge), as vLLM's
  per-request output collector does. So a client that reads slower than tokens are committed
  gets fewer, larger chunks, and each chunk that crosses Serve's proxy (about 1 ms of CPU
  each) carries as many tokens as are ready; the stream never waits for the reader. An error is
  raised to the reader after the items before it. Closing the async iterator (a cancelled
  call, a client gone) cancels the task, which closes the stream: the request's sessions are
  freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.api.client import DEADLINE_METADATA_KEY
from cluster.routing.waits import Wait, drive
from cluster.runtime.errors import InvalidArgumentError

T = TypeVar("T")
_ITEM, _END, _ERROR = "item", "end", "error"


async def stream_on_loop(
    steps: Iterator[T | Wait],
    merge: Callable[[list[T]], list[T]],
    start_on: ThreadPoolExecutor | None = None,
) -> AsyncGenerator[T, None]:
    """A stream of waits (`cluster.routing.waits`) whose waits need no thread, on the event loop:
    a task of the running loop runs them to their end, awaiting each wait, and the
    reader gets what is pending merged, as there; the first step runs on `start_on`, if given
    (`drive`). Closing this cancels the task, which closes the stream (the request's sessions
    are freed)."""
    pending: list[tuple[str, Any]] = []
    arrived = asyncio.Event()

    def deliver(kind: str, value: Any) -> None:
        pending.append((kind, value))
        arrived.set()

    async def produce() -> None:
        try:
            async for item in drive(steps, start_on):
                deliver(_ITEM, item)
            deliver(_END, None)
        except Exception as error:
            deliver(_ERROR, error)

    task = asyncio.get_running_loop().create_task(produce())
    try:
        async for item in _merged(pending, arrived, merge):
            yield item
    finally:
        task.cancel()


def stream_merged(
    steps: Iterator[T | Wait],
    threads: ThreadPoolExecutor,
    merge: Callable[[list[T]], list[T]],
) -> AsyncGenerator[T, None]:
    """A Tandem stream's steps, merged for a lagging reader: on the loop (`stream_on_loop`),
    the request's set-up (its first step: validation, tokenization, its sessions' opening) on
    `threads`."""
    return stream_on_loop(steps, merge, threads)


async def _merged(
    pending: list[tuple[str, Any]], arrived: asyncio.Event, merge: Callable[[list[T]], list[T]]
) -> AsyncGenerator[T, None]:
    """What a producer `deliver`s to `pending`, merged as it is read; its error raised after
    the items before it."""
    while True:
        if not pending:
            arrived.clear()
            await arrived.wait()
        taken = pending[:]
        pending.clear()
        arrivals = [value for kind, value in taken if kind == _ITEM]
        for item in merge(arrivals) if arrivals else ():
            yield item
        kind, value = taken[-1]
        if kind == _ERROR:
            raise value
        if kind == _END:
            return


def deadline_of(
    metadata: Iterable[tuple[str, str]], now: Callable[[], float] = time.monotonic
) -> float | None:
    """The `now()` instant the `x-tandem-deadline-ms` entry of `metadata` ends at; None
    without one. Raises `InvalidArgumentError` for a value that is not an integer."""
    values = [value for key, value in metadata if key.lower() == DEADLINE_METADATA_KEY]
    if not values:
        return None
    text = str(values[-1]).strip()
    try:
        left_ms = int(text)
    except ValueError:
        raise InvalidArgumentError(
            f"{DEADLINE_METADATA_KEY} metadata must be an integer count of milliseconds left, "
            f"got {text!r}"
        ) from None
    return now() + left_ms / 1000
