"""A replica's batching engine: one thread owns the model runner and packs the pending work of
every session into one forward pass per step.

Callers (gRPC handler threads, or a router in the same process) never touch the model, the KV
pool or the session table. They hand the engine a *task*, a generator that holds one call's
logic (`cluster.runtime.task`: it yields a `Forward` for logits or a `Batched` to be served
with the step's others), and wait for its result (`run`, or `submit` for a future). The engine
thread drives every task, so a component's state has a single writer and needs no lock, and
nothing is ever held across a forward pass.

Tasks with the same `key` (a session id) run one after another, in submission order; tasks
with different keys interleave freely. A task with no key runs between steps (housekeeping:
eviction, stats). A task submitted with `closes=True` ends its key's session: no step waits for
that key to come back. A session that advances on its own (a verifier's running session)
registers a maker of its next task (`keep_running`), so it is in every step it has input for.

This module is the thread and the callers' face: the inbox, the loop, the wait for sessions
about to come back (`_gather`), the step listeners (called on the engine thread at the end of
every loop iteration in which some task finished, after the done-callbacks of the futures it
resolved: a Frames stream's one frame per step, `cluster.replica.frames`), and the figures
(`stats`, `step_load`, `expected_wait_s`, `calibrate`). The tasks and the policy (what goes
into a step, whom a step waits for) are the `Scheduler`'s (`cluster.runtime.scheduler`);
driving tasks and running steps, the `Stepper`'s (`cluster.runtime.stepper`); the counters, one
`EngineCounters` record (`cluster.runtime.engine_counters`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from cluster.runtime.block_runner import ModelRunner, SequenceWork
from cluster.runtime.call_scope import caller_gone
from cluster.runtime.draft_block import StepLoad
from cluster.runtime.engine_counters import EngineCounters
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.limits import DEFAULT_MAX_STEP_SEQUENCES, DEFAULT_MAX_STEP_TOKENS, GATHER_SHARE
from cluster.runtime.scheduler import Scheduler
from cluster.runtime.stepper import Stepper
from cluster.runtime.task import Forward, Running, Task

logger = logging.getLogger(__name__)

R = TypeVar("R")

ROOM_WAIT_S = 0.01
"""How long a step that could run nothing waits for a call before it looks again."""


class Engine:
    """The step loop of one replica over one `ModelRunner` (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        max_step_sequences: int = DEFAULT_MAX_STEP_SEQUENCES,
        name: str = "engine",
        clock: Callable[[], float] = time.perf_counter,
        gather_share: float = GATHER_SHARE,
    ) -> None:
        if max_step_tokens < 1 or max_step_sequences < 1:
            raise InvalidArgumentError("max_step_tokens and max_step_sequences must be >= 1")
        if not 0 <= gather_share <= 1:
            raise InvalidArgumentError(f"gather_share must be in [0, 1], got {gather_share}")
        self.runner = runner
        self.max_step_tokens = max_step_tokens
        self.max_step_sequences = max_step_sequences
        self._clock = clock
        self.counters = EngineCounters()
        """The engine's figures (written by the engine thread, read by anyone)."""
        self._scheduler = Scheduler(
            max_step_tokens, max_step_sequences, clock=clock, gather_share=gather_share
        )
        self._stepper = Stepper(runner, self._scheduler, self.counters, clock)
        self._condition = threading.Condition()
        self._inbox: deque[Running] = deque()
        self._stopped = False
        self._step_listeners: tuple[Callable[[], None], ...] = ()
        """Called on the engine thread after an iteration in which a task finished."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (any thread)

    def submit(self, task: Task[R], key: str | None = None, *, closes: bool = False) -> Future[R]:
        """Queue `task`; its future resolves to what it returns (or raises what it raises).

        `closes`: the task ends the session of `key` (a close), so the engine does not expect
        the key back after it; a later task of the key is a new session's."""
        if closes and key is None:
            raise InvalidArgumentError("only a keyed task can close its key")
        future: Future[R] = Future()
        running = Running(task, key, future, self._clock(), closes=closes, gone=caller_gone())
        with self._condition:
            if self._stopped:
                task.close()
                raise RuntimeError("the engine has stopped")
            self._inbox.append(running)
            self._condition.notify()
        return future

    def run(self, task: Task[R], key: str | None = None, *, closes: bool = False) -> R:
        """Run `task` and return its result (blocking the calling thread, not the engine);
        `closes` as for `submit`."""
        return self.submit(task, key, closes=closes).result()

    def call(self, fn: Callable[[], R], key: str | None = None, *, closes: bool = False) -> R:
        """Run `fn()` on the engine thread, between steps; `closes` as for `submit`."""
        return self.submit_call(fn, key, closes=closes).result()

    def submit_call(
        self, fn: Callable[[], R], key: str | None = None, *, closes: bool = False
    ) -> Future[R]:
        """`call` without waiting: a future of `fn()`'s result."""

        def task() -> Task[R]:
            return fn()
            yield  # a generator that yields nothing

        return self.submit(task(), key, closes=closes)

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` on the engine thread at the end of every loop iteration in which
        some task finished, after that step's forward pass, its Batched handlers and the
        done-callbacks of the futures it resolved. It must be quick and must not raise (an
        exception is logged and dropped): it runs between steps."""
        with self._condition:
            self._step_listeners = (*self._step_listeners, listener)

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling `listener` (no error if it was not added)."""
        with self._condition:
            self._step_listeners = tuple(fn for fn in self._step_listeners if fn != listener)

    def keep_running(self, key: str, make: Callable[[], Task[Any] | None]) -> None:
        """From now on, whenever `key` has no task active or queued before a step, start
        `make()` for it (engine thread only: a task of `key` calls this). `make` returns None
        once the session has nothing more to do, and then unregisters it (`stop_running`)."""
        assert self.on_engine_thread, "keep_running is called from a task"
        self._scheduler.keep_running(key, make)

    def stop_running(self, key: str) -> None:
        """`key` no longer advances on its own (engine thread only; unknown keys: nothing)."""
        self._scheduler.stop_running(key)

    def is_running(self, key: str) -> bool:
        """Whether `key` advances on its own (engine thread: exact)."""
        return self._scheduler.is_running(key)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop; tasks not finished fail with RuntimeError."""
        with self._condition:
            self._stopped = True
            self._condition.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def on_engine_thread(self) -> bool:
        """Whether the calling thread is the engine's (where step listeners will run before
        the loop goes on)."""
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and takes calls (False once it has stopped or
        died: every call then fails)."""
        return self._thread.is_alive() and not self._stopped

    @property
    def active_keys(self) -> frozenset[str]:
        """Keys of the tasks running or queued now (engine thread: exact)."""
        return self._scheduler.active_keys()

    def has_work(self) -> bool:
        """Whether any call is queued or running now. Any thread may ask; the answer is a
        snapshot, possibly stale once read: for work that yields to calls (an audit's
        replay), never for correctness."""
        return bool(self._inbox) or self._scheduler.has_work()

    def expected_wait_s(self) -> float:
        """About how long a call submitted now waits before a step takes it: the smoothed wait
        of recent calls while the engine has work, else 0 (any thread may ask: a snapshot)."""
        return self.counters.queue_wait_s if self.has_work() else 0.0

    def step_load(self) -> StepLoad | None:
        """The load of the step that ran last (what a task resumed after it ran in)."""
        return self.counters.load

    def stats(self) -> EngineStats:
        return self.counters.snapshot(
            self.runner,
            queued=len(self._inbox) + self._scheduler.num_queued,
            step_running_s=self._stepper.step_running_s(),
        )

    def calibrate(self, token_counts: Sequence[int] = (1, 16, 64), repeats: int = 2) -> None:
        """Seed the cost curve (and warm the model up) with steps of a scratch sequence of
        each size; the sequence is released after. Call before serving."""

        def task() -> Task[None]:
            seq_id = "\x00calibration"
            try:
                for _ in range(repeats):
                    for count in token_counts:
                        tokens = min(count, self.max_step_tokens)
                        yield Forward(SequenceWork(seq_id, (0,) * tokens, (tokens - 1,)))
                        self.runner.truncate(seq_id, 0)
            finally:
                self.runner.release(seq_id)

        try:
            self.run(task(), key="\x00calibration")
        except ResourceExhaustedError:
            logger.warning("engine calibration skipped: the KV pool is too small for it")
            return
        self.counters.calibrated()

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        stepper, scheduler = self._stepper, self._scheduler
        try:
            while True:
                with self._condition:
                    while not self._stopped and not self._inbox and not scheduler.has_forward():
                        self._condition.wait()
                    if self._stopped:
                        break
                    arrived = list(self._inbox)
                    self._inbox.clear()
                for running in arrived:
                    stepper.admit(running)
                stepper.run_keyless()
                stepper.fill_running()
                if scheduler.has_forward():
                    self._gather()
                    stepper.fill_running()
                    self._step()
                stepper.fill_running()
                self._notify_listeners()
        except BaseException:  # never die silently: fail every caller instead
            logger.exception("engine loop failed")
            raise
        finally:
            self._fail_all(RuntimeError("the engine has stopped"))

    def _step(self) -> None:
        """One step (`Stepper.step`); when nothing could run, a short wait for a call."""
        if not self._stepper.step():
            self._wait_for_room()

    def _notify_listeners(self) -> None:
        """Call the step listeners if a task finished since they last ran."""
        if not self._stepper.take_finished():
            return
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:  # a listener's fault must not stop the engine
                logger.exception("a step listener failed")

    def _gather(self) -> None:
        """Wait a little for sessions about to come back before stepping: the scheduler names
        them and the longest wait (`Scheduler.to_gather`); this admits what arrives meanwhile.
        Counts `gathers` and `gather_s` only when some session is expected."""
        expected, window_s = self._scheduler.to_gather(self.counters.predicted_step_s())
        if not expected:
            return
        self.counters.gathering()
        started = self._clock()
        try:
            self._wait_for(expected, started + window_s)
        finally:
            self.counters.add_gather(self._clock() - started)

    def _wait_for(self, expected: set[str], deadline: float) -> None:
        """Admit what arrives until every `expected` key is back or `deadline` passes."""
        while expected:
            with self._condition:
                left_s = deadline - self._clock()
                if left_s <= 0 or self._stopped:
                    return
                if not self._inbox:
                    self._condition.wait(left_s)
                arrived = list(self._inbox)
                self._inbox.clear()
            for running in arrived:
                self._stepper.admit(running)
                expected.discard(running.key)
            self._stepper.run_keyless()

    def _wait_for_room(self) -> None:
        """Nothing could run (every ready task waits for blocks older sessions hold): wait
        for a call to arrive, or a little, rather than spin."""
        with self._condition:
            if not self._inbox and not self._stopped:
                self._condition.wait(ROOM_WAIT_S)

    def _fail_all(self, error: BaseException) -> None:
        with self._condition:
            self._stopped = True
            pending = list(self._inbox)
            self._inbox.clear()
        self._stepper.fail_all(pending, error)
        if threading.current_thread() is self._thread:
            self._notify_listeners()
