"""What both faces of the router ingress share about a call: reading the deadline it states,
and running its blocking work off the event loop.

The gRPC face (`cluster.serve.ingress`) and the OpenAI-compatible HTTP face
(`cluster.serve.http`) both import this module and it imports neither, so the two faces never
import each other's helpers (the ingress builds the HTTP face; nothing imports back up).

- `deadline_of`: the deadline a caller states in `x-tandem-deadline-ms` (gRPC metadata or HTTP
  headers alike: pairs of name and value), as an instant of the local clock; the ingress's
  docstring says how it is honoured.
- `iterate_in_thread`: a blocking generator (a Tandem stream) bridged to the event loop one
  item at a time on a thread pool; closing the async iterator (a cancelled call) closes the
  generator on the pool, after the step in flight, also when that step was cancelled while it
  still waited for a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.api.client import DEADLINE_METADATA_KEY
from cluster.runtime.errors import InvalidArgumentError

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(
    items: Generator[T, None, None], threads: ThreadPoolExecutor
) -> AsyncGenerator[T, None]:
    """Yield from a blocking generator, each step on `threads`; closing this closes it there."""
    step: Future[Any] | None = None
    try:
        while True:
            step = threads.submit(next, items, _DONE)
            item = await asyncio.wrap_future(step)
            step = None
            if item is _DONE:
                return
            yield item
    finally:
        in_flight = step

        def close() -> None:
            # A generator cannot be closed while it runs: wait for the step in flight. A step
            # cancelled before a thread took it is done at once (`exception()` would raise).
            if in_flight is not None:
                futures.wait([in_flight])
            items.close()

        threads.submit(close)


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
