"""Waiting on replicas without a thread: a request's loop as work that yields its waits.

A request's router loop spends nearly all its time waiting for a replica's answer (a frame
entry's future). Written as a plain function it must hold a thread while it waits, so 1,000
streams would cost 1,000 threads and a thread wake for every answer. Written as **waits** (a
generator, `Waits[T]`, that yields a `Wait` wherever it would block, and goes on once it is
resumed), one driver can run any number of requests:

- `run(work)` and `blocking(stream)` resume each wait on the calling thread, blocking until
  it is over: the synchronous APIs (`Router.stream`, `TandemService.stream`), tests and the
  in-process transport, unchanged in what they do;
- `drive(stream)` awaits each wait on an asyncio event loop: the router replica's own gRPC
  server runs every stream this way on one loop (`cluster.serve.front`).

A wait ends when its future is done or its `timeout_s` has passed, whichever is first: the code
that yielded it reads the future next and decides (a timeout is its own to raise). The work
never receives a value from the driver, so it is run with `next` alone, and `yield from`
composes it. A stream yields its output (chunks) between its waits. ("Step" is the engine's
word, one forward pass of a replica; the work here runs between them.)

`Started` begins work at once and finishes it later. `Pending` runs work beside a request's
own loop: the loop waits on whichever comes first (`first_done`) of its own events and the
pending work's current wait, and `poll`s it forward once that is over (a draft in flight while
the request goes on reading its verifier's reports). `returning` and `answer` make waits of
values and futures that need no thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")
Waits = Generator["Wait", None, T]
"""Work that yields a `Wait` wherever it would block and returns its result (see above)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """A step's pause until `future` is done or `timeout_s` has passed (None: no limit)."""

    future: Future[Any]
    timeout_s: float | None = None

    def block(self) -> None:
        """Wait here, on this thread."""
        if not self.future.done():
            concurrent.futures.wait((self.future,), timeout=self.timeout_s)

    async def wait_async(self) -> None:
        """Wait on the running event loop (the future's thread wakes the loop, not a thread of
        the request's own); a timeout leaves the future running for the step to deal with.
        Lighter than `asyncio.wrap_future` with `asyncio.wait`: one loop future, one callback
        and, with a timeout, one timer; futures done together on another thread (a frame's
        answers) wake the loop once (`LoopWaker`)."""
        if self.future.done():
            return
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        waker = LoopWaker.of(loop)
        self.future.add_done_callback(lambda _: waker.wake(woken))
        if self.timeout_s is None:
            await woken
            return
        timer = loop.call_later(self.timeout_s, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()


class LoopWaker:
    """Wakes loop futures from other threads in batches: the first wake since the loop last
    ran its batch asks the loop to run one (`call_soon_threadsafe`: a write to its wakeup
    pipe), and the wakes that follow before it runs join that batch. A frame that answers 64
    sessions then costs one wakeup of the loop, not 64."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker]] = (
        weakref.WeakKeyDictionary()
    )
    _made: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Future[None]] = []
        self._asked = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopWaker:
        """The waker of `loop` (made once)."""
        waker = cls._by_loop.get(loop)
        if waker is None:
            with cls._made:
                waker = cls._by_loop.setdefault(loop, cls(loop))
        return waker

    def wake(self, woken: asyncio.Future[None]) -> None:
        """Set `woken` on the loop, soon (any thread)."""
        with self._lock:
            self._due.append(woken)
            if self._asked:
                return
            self._asked = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            due, self._due, self._asked = self._due, [], False
        for woken in due:
            _wake(woken)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def run(work: Waits[T]) -> T:
    """Run `work` to its result on this thread, blocking at each wait."""
    try:
        wait = next(work)
        while True:
            wait.block()
            wait = next(work)
    except StopIteration as stop:
        return stop.value


def blocking(stream: Iterator[T | Wait]) -> Generator[T, None, None]:
    """The output of a stream, blocking at each wait on the consumer's thread.
    Closing this closes `stream` (what frees a request's sessions)."""
    try:
        for item in stream:
            if isinstance(item, Wait):
                item.block()
            else:
                yield item
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


async def drive(stream: Iterator[T | Wait], start_on: Executor | None = None) -> AsyncIterator[T]:
    """The output of a stream on the running event loop: its code runs on the loop's
    thread and each wait is awaited there. `start_on`: the stream's start (a request's set-up up to
    its first wait: validation, tokenization, its sessions' opening) runs there instead, so
    that starting requests never holds up the others' streams on the loop. Closing (or
    cancelling) this closes `stream`, on `start_on` if given (`_close`)."""
    starting: Future[Any] | None = None
    ended = False
    try:
        if start_on is not None:
            starting = start_on.submit(next, stream, _NO_MORE)
            first = await asyncio.wrap_future(starting)
            if first is _NO_MORE:
                ended = True
                return
            if isinstance(first, Wait):
                await first.wait_async()
            else:
                yield first
        for item in stream:
            if isinstance(item, Wait):
                await item.wait_async()
            else:
                yield item
        ended = True
    finally:
        close = getattr(stream, "close", None)
        if close is not None and not ended:
            _close(close, starting, start_on)


def _close(close: Callable[[], None], starting: Future[Any] | None, on: Executor | None) -> None:
    """Close a stream `drive` left: after its start if that still runs (`starting`); on
    `on` if given, since closing may block (the request's sessions close, and an open in flight
    ends first), and not on the loop the other requests' streams run on."""
    if starting is not None and not starting.done():
        starting.add_done_callback(lambda _: close())
        return
    if on is not None:
        try:
            on.submit(close)
            return
        except RuntimeError:  # the executor has shut down: close here
            pass
    close()


_NO_MORE = object()
"""What `next` returns for a stream that ended before its first wait."""


def finishing(work: Waits[T]) -> Waits[T]:
    """`work` that must run whatever happens (closing a request's sessions, or opening one
    that must then be closed): if their consumer closes them at a wait (it left), they finish
    on the closing thread, blocking, and what they raise then is dropped."""
    wait: Wait | None = None
    try:
        while True:
            try:
                wait = next(work)
            except StopIteration as stop:
                return stop.value
            yield wait
    except GeneratorExit:
        with contextlib.suppress(Exception):  # nobody is left to be told
            if wait is not None:
                wait.block()
            run(work)
        raise


def quietly(work: Waits[object]) -> Waits[None]:
    """`work` run for its effect alone: what they raise is dropped."""
    try:
        yield from work
    except Exception:
        return


def returning(value: T) -> Waits[T]:
    """Work that waits for nothing and returns `value`."""
    return value
    yield  # pragma: no cover - makes this a generator


def answer(future: Future[T], timeout_s: float | None = None) -> Waits[T]:
    """Work that waits for `future` and returns its result (or raises its error); a future not
    done within `timeout_s` raises `concurrent.futures.TimeoutError`."""
    if not future.done():
        yield Wait(future, timeout_s)
    return future.result(timeout=0)


def calling(call: Callable[[], T]) -> Waits[T]:
    """Work that makes a blocking `call` when run (a port with no waits of its own)."""
    return call()
    yield  # pragma: no cover - makes this a generator


class Started:
    """Work begun now, up to its first wait (the request behind it is sent at once), and
    finished later by `yield from started.finish()`."""

    def __init__(self, work: Waits[T]) -> None:
        self._work = work
        self._first: Wait | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished_at: float | None = None
        try:
            self._first = next(work)
        except StopIteration as stop:
            self._result, self._finished_at = stop.value, time.perf_counter()
        except Exception as error:  # raised again by `finish`, on the request's own path
            self._error, self._finished_at = error, time.perf_counter()
        else:
            self._first.future.add_done_callback(self._answered)

    def _answered(self, _: Future[Any]) -> None:
        self._finished_at = time.perf_counter()

    def done(self) -> bool:
        """Whether the answer it first waits for is in (or it needed none)."""
        return self._first is None or self._first.future.done()

    @property
    def finished_at(self) -> float | None:
        """When that answer came (`time.perf_counter()`), if it has."""
        return self._finished_at

    def finish(self) -> Waits[Any]:
        """The rest of the work: its result, or what they raised."""
        if self._error is not None:
            raise self._error
        if self._first is None:
            return self._result
        yield self._first
        return (yield from self._work)


def first_done(futures: list[Future[Any]]) -> Future[Any]:
    """A future done as soon as any of `futures` is (the one given, if there is only one)."""
    if len(futures) == 1:
        return futures[0]
    either: Future[Any] = Future()

    def done(_: Future[Any]) -> None:
        if not either.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                either.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    return either


class Pending:
    """Work run beside a request's loop (see the module docstring): begun at once, up to its
    first wait; `poll` resumes it whenever the wait it stopped at is over (its future done,
    or its timeout passed, which the work then handles itself), until it returns."""

    def __init__(self, work: Waits[Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._work = work
        self._clock = clock
        self._wait: Wait | None = None
        self._until: float | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.done = False
        self._resume()

    @property
    def future(self) -> Future[Any] | None:
        """What the work waits for now (None once it has returned)."""
        return None if self._wait is None else self._wait.future

    @property
    def until(self) -> float | None:
        """When the wait it stopped at times out (None: never, or no wait)."""
        return self._until

    def poll(self) -> bool:
        """Resume the work if its wait is over; whether it has returned."""
        if self.done or self._wait is None:
            return self.done
        over = self._until is not None and self._clock() >= self._until
        if self._wait.future.done() or over:
            self._resume()
        return self.done

    def result(self) -> Any:
        """What the work returned (or raise what it raised); only once `done`."""
        assert self.done
        if self._error is not None:
            raise self._error
        return self._result

    def close(self) -> None:
        """Give the work up (closing the generator)."""
        self._work.close()
        self._wait = None

    def _resume(self) -> None:
        while True:
            try:
                wait = next(self._work)
            except StopIteration as stop:
                self._finish(stop.value, None)
                return
            except Exception as error:  # raised again by `result`, on the request's path
                self._finish(None, error)
                return
            if not wait.future.done():
                self._wait = wait
                timeout = wait.timeout_s
                self._until = None if timeout is None else self._clock() + timeout
                return

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._wait, self._until = None, None
        self.done = True
