"""A replica's batching engine: one thread owns the model runner and packs the pending work of
every session into one forward pass per step.

Callers (gRPC handler threads, or a router in the same process) never touch the model, the KV
pool or the session table. They hand the engine a *task*, a generator that holds one call's
logic, and wait for its result (`run`, or `submit` for a future). The engine thread drives every
task, so a component's state has a single writer and needs no lock, and nothing is ever held
across a forward pass. A task yields what it needs next (`cluster.runtime.task`):

- `Forward(work)`: logits for a `SequenceWork` (the runner's unit). Every task waiting on one
  joins the next step; the engine sends back the rows (float32 `[len(logits_at), vocab]`), or
  throws the runner's error into the task (a `PoolExhaustedError` when the KV pool cannot hold
  it). A long item (a prompt) is split into chunks over several steps (chunked prefill), so it
  never stalls the others for long.
- `Batched(handler, payload)`: after a step, every task waiting on the same handler is served
  by one call `handler([payload, ...])`, which returns one result (or exception) per payload:
  how a verifier accepts all its blocks in one vectorised rejection-sampling call.

Tasks with the same `key` (a session id) run one after another, in submission order; tasks
with different keys interleave freely. A task with no key runs between steps (housekeeping:
eviction, stats). A task submitted with `closes=True` ends its key's session (closing it): the
engine forgets the key after it, so no step waits for that session to come back (`_gather`).

This module is the step loop: the inbox and the thread, admitting tasks, driving them, running
each step's forward pass and its Batched handlers, and waiting (`_gather`) for the sessions the
scheduler expects back. What goes into a step (the token and sequence budgets, small items
before prefill chunks, admission by free KV blocks) and whom a step waits for, and how long,
are the scheduler's policy (`cluster.runtime.scheduler`). An item that cannot fit in the KV
pool at all fails at once here (RESOURCE_EXHAUSTED with a retry hint), never an out-of-memory
crash. When the pool runs short, the scheduler makes room for the oldest sessions by preempting
newer ones: the engine frees a victim's blocks (`_preempt`) and its session recomputes them on
its next step (a task waiting on a preemptible Forward gets `Preempted` and plans again), so a
full pool delays requests instead of failing them. Counted: `preemptions`, `recomputed_tokens`,
`refusals`.

Running sessions (`keep_running`): a session that advances on its own (a verifier's session
generating with nothing else to do) registers a maker of its next task. Before every step, each
running key with no task active or queued gets one (`_fill_running`), so every running session
with a next input is in every step, whatever its caller does between steps; a maker that
returns None has nothing more to do (it unregisters itself: `stop_running`). The engine counts
how many running sessions each step carried against how many were registered (`occupancy`).

Step listeners (`add_step_listener`): the engine thread calls each once at the end of every
loop iteration in which some task finished (after the step's forward pass and its Batched
handlers), so a caller that collects results as their futures complete (a future's
done-callbacks run on the engine thread when its result is set, before the listeners) can send
everything one step produced at once: a Frames stream's one ReplicaFrame per step
(`cluster.replica.frames`).

The engine measures itself: steps, the largest batch, tokens and sessions per step, queue
wait, the split of its time (`busy_s`, `forward_s`, `batched_s`, `gather_s`, `gathers`), and
the step cost curve (`cluster.runtime.cost_curve`, seeded by `calibrate` at startup), which
the router uses to price speculation under load (`StepLoad`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from cluster.runtime.call_scope import caller_gone
from cluster.runtime.cost_curve import CostCurve, smooth
from cluster.runtime.draft_block import StepLoad
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import CancelledError, InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.limits import DEFAULT_MAX_STEP_SEQUENCES, DEFAULT_MAX_STEP_TOKENS, GATHER_SHARE
from cluster.runtime.runner import ModelRunner, PoolExhaustedError, SequenceWork
from cluster.runtime.scheduler import Scheduler, remaining
from cluster.runtime.task import Batched, Forward, Preempted, Running, Task
from cluster.runtime.token_choice import greedy_tokens, row_argmax

__all__ = [
    "Batched",
    "Engine",
    "Forward",
    "Preempted",
    "Task",
]
"""The engine's public names; the task protocol lives in `task` and is re-exported here (the
budgets' defaults live in `limits`)."""

logger = logging.getLogger(__name__)

R = TypeVar("R")

RETRY_AFTER_S = 1.0
"""Retry hint sent with a refusal for lack of KV blocks."""
MAX_INSTANT_TASKS = 4
"""Tasks of a running key started in a row when each ends without a step."""
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
        self._scheduler = Scheduler(
            max_step_tokens, max_step_sequences, clock=clock, gather_share=gather_share
        )
        self._condition = threading.Condition()
        self._inbox: deque[Running] = deque()
        self._stopped = False
        # Engine-thread state.
        self._active: dict[str | None, Running] = {}
        self._keyless: list[Running] = []
        self._queued: dict[str, deque[Running]] = {}
        self._num_queued = 0
        self._curve = CostCurve()
        self._load: StepLoad | None = None
        # Figures (written by the engine thread, read by anyone).
        self.busy_s = 0.0
        # Seconds since start, for the split of a round's time (`EngineStats`): in the
        # runner's forward, in Batched handlers (acceptance), and waiting in `_gather`.
        self.forward_s = 0.0
        self.batched_s = 0.0
        self.gather_s = 0.0
        self.gathers = 0
        self.abandoned = 0
        """Tasks dropped because their caller had gone."""
        self.preemptions = 0
        """Sequences whose KV blocks were freed for an older session's growth."""
        self.recomputed_tokens = 0
        """Tokens run again to rebuild KV that preemptions freed."""
        self.refusals = 0
        """Tasks failed because their work could not fit in the whole KV pool."""
        self._running: dict[str, Callable[[], Task[Any] | None]] = {}
        """Per running key, the maker of its next task (`keep_running`); engine thread."""
        self.running_sessions = 0
        """Running sessions registered, summed over the steps since start."""
        self.running_stepped = 0
        """Of those, the ones each step carried (`occupancy` is the ratio)."""
        self.startup_line = (0.0, 0.0)
        """The cost curve as `calibrate` measured it before serving: (base_s, per_token_s)."""
        self._to_recompute: dict[str, int] = {}
        """Per preempted sequence, the freed tokens not yet run again."""
        self._step_listeners: tuple[Callable[[], None], ...] = ()
        """Called on the engine thread after an iteration in which a task finished."""
        self._finished_any = False
        """Some task finished in this loop iteration (engine thread)."""
        self._steps = 0
        self._max_batch = 0
        self._mean_batch = 0.0
        self._mean_tokens = 0.0
        self._queue_wait_s = 0.0
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
        self._running[key] = make

    def stop_running(self, key: str) -> None:
        """`key` no longer advances on its own (engine thread only; unknown keys: nothing)."""
        self._running.pop(key, None)

    def is_running(self, key: str) -> bool:
        """Whether `key` advances on its own (engine thread: exact)."""
        return key in self._running

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
        keys = {k for k in self._active if k is not None}
        return frozenset(keys | set(self._queued))

    def has_work(self) -> bool:
        """Whether any call is queued or running now. Any thread may ask; the answer is a
        snapshot, possibly stale once read: for work that yields to calls (an audit's
        replay), never for correctness."""
        return bool(self._inbox or self._active or self._keyless)

    def _step_running_s(self) -> float:
        started = self._step_started  # one read: the engine thread may clear it meanwhile
        return 0.0 if started is None else max(0.0, self._clock() - started)

    def expected_wait_s(self) -> float:
        """About how long a call submitted now waits before a step takes it: the smoothed wait
        of recent calls while the engine has work, else 0 (any thread may ask: a snapshot)."""
        return self._queue_wait_s if self.has_work() else 0.0

    def step_load(self) -> StepLoad | None:
        """The load of the step that ran last (what a task resumed after it ran in)."""
        return self._load

    def stats(self) -> EngineStats:
        base, per_token = self._curve.line()
        runner = self.runner
        return EngineStats(
            runner=runner.kind,
            steps=self._steps,
            max_batch_sequences=self._max_batch,
            kv_blocks_total=runner.num_blocks,
            kv_blocks_used=runner.num_blocks - runner.num_free_blocks,
            block_size=runner.block_size,
            batch_sequences=self._mean_batch,
            step_tokens=self._mean_tokens,
            queue_wait_s=self._queue_wait_s,
            queued=len(self._inbox) + self._num_queued,
            cost_base_s=base,
            cost_per_token_s=per_token,
            busy_s=self.busy_s,
            step_running_s=self._step_running_s(),
            forward_s=self.forward_s,
            device_s=float(getattr(runner, "device_s", self.forward_s)),
            batched_s=self.batched_s,
            gather_s=self.gather_s,
            gathers=self.gathers,
            preemptions=self.preemptions,
            recomputed_tokens=self.recomputed_tokens,
            refusals=self.refusals,
            running_sessions=self.running_sessions,
            running_stepped=self.running_stepped,
            startup_base_s=self.startup_line[0],
            startup_per_token_s=self.startup_line[1],
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
        self.startup_line = self._curve.line()

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        try:
            while True:
                with self._condition:
                    while not self._stopped and not self._inbox and not self._has_forward():
                        self._condition.wait()
                    if self._stopped:
                        break
                    arrived = list(self._inbox)
                    self._inbox.clear()
                for running in arrived:
                    self._admit(running)
                self._run_keyless()
                self._fill_running()
                if self._has_forward():
                    self._gather()
                    self._fill_running()
                    self._step()
                self._fill_running()
                self._notify_listeners()
        except BaseException:  # never die silently: fail every caller instead
            logger.exception("engine loop failed")
            raise
        finally:
            self._fail_all(RuntimeError("the engine has stopped"))

    def _notify_listeners(self) -> None:
        """Call the step listeners if a task finished since they last ran."""
        if not self._finished_any:
            return
        self._finished_any = False
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:  # a listener's fault must not stop the engine
                logger.exception("a step listener failed")

    def _gather(self) -> None:
        """Wait a little for sessions about to come back before stepping: the scheduler names
        them and the longest wait (`Scheduler.to_gather`); this admits what arrives meanwhile.
        Counts `gathers` and `gather_s` only when some session is expected."""
        base, per_token = self._curve.line()
        expected, window_s = self._scheduler.to_gather(
            self._active, base + per_token * self._mean_tokens
        )
        if not expected:
            return
        self.gathers += 1
        started = self._clock()
        try:
            self._wait_for(expected, started + window_s)
        finally:
            self.gather_s += self._clock() - started

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
                self._admit(running)
                expected.discard(running.key)
            self._run_keyless()

    def _fill_running(self) -> None:
        """Start the next task of every running key that has none (`keep_running`). A task
        that ends without a step (a deferred token emitted, a stale block dropped) is followed
        by the next at once, up to `MAX_INSTANT_TASKS` in a row."""
        if not self._running:
            return
        now = self._clock()
        for key in list(self._running):
            for _ in range(MAX_INSTANT_TASKS):
                if key in self._active or key in self._queued:
                    break
                make = self._running.get(key)
                task = make() if make is not None else None
                if task is None:
                    self._running.pop(key, None)
                    break
                running = Running(task, key, None, now)
                running.waited = True  # no caller queued it
                self._active[key] = running
                self._advance(running, None, None)

    def _has_forward(self) -> bool:
        return any(isinstance(r.waiting, Forward) for r in self._active.values())

    def _admit(self, running: Running) -> None:
        self._scheduler.arrived(running)
        if running.key is None:
            self._keyless.append(running)
        elif running.key in self._active:
            self._queued.setdefault(running.key, deque()).append(running)
            self._num_queued += 1
        else:
            self._start(running)

    def _run_keyless(self) -> None:
        while self._keyless:
            running = self._keyless.pop(0)
            self._advance(running, None, None, keyed=False)

    def _start(self, running: Running) -> None:
        self._active[running.key] = running
        self._advance(running, None, None)

    def _advance(
        self,
        running: Running,
        value: Any,
        error: BaseException | None,
        keyed: bool = True,
    ) -> None:
        """Resume a task with `value` (or throw `error` into it) until it waits on a Forward,
        or finishes; a Batched it yields is served at once when it is alone (between steps)."""
        while True:
            try:
                if error is not None:
                    request = running.task.throw(error)
                else:
                    request = running.task.send(value)
            except StopIteration as stop:
                self._finish(running, stop.value, None, keyed)
                return
            except BaseException as failure:  # the task's own error goes to its caller
                self._finish(running, None, failure, keyed)
                return
            value, error = None, None
            if isinstance(request, Forward):
                running.waiting = request
                running.ready_since = self._clock()
                running.done_tokens = 0
                running.rows = []
                if not keyed:
                    error = RuntimeError("a keyless task cannot run forward passes")
                    continue
                return
            if isinstance(request, Batched):
                running.waiting = request
                if not self._in_step:
                    value, error = _one(request.handler([request.payload]))
                    continue
                return
            error = TypeError(f"a task yielded {type(request).__name__}, not Forward or Batched")

    _in_step = False

    def _finish(
        self, running: Running, result: Any, failure: BaseException | None, keyed: bool
    ) -> None:
        running.waiting = None
        self._finished_any = True
        if self._in_step:
            self._count_busy()  # before the caller can return and read `busy_s`
        future = running.future
        if future is None:  # a running session's own step: it reports itself
            if failure is not None:
                logger.error("a running session's step failed", exc_info=failure)
        elif failure is None:
            future.set_result(result)
        else:
            future.set_exception(failure)
        if not keyed or running.key is None:
            return
        del self._active[running.key]
        self._scheduler.finished(
            running, active=len(self._active), queued=bool(self._queued.get(running.key))
        )
        queue = self._queued.get(running.key)
        if queue:
            following = queue.popleft()
            self._num_queued -= 1
            if not queue:
                del self._queued[running.key]
            self._start(following)

    def _step(self) -> None:
        self._drop_abandoned()
        started = self._clock()
        batch, chunks = self._scheduler.pack(
            self._active.values(), self.runner, self._refuse, self._preempt
        )
        if not batch:
            self._wait_for_room()
            return
        self._in_step = True
        self._step_started = started
        self._busy_since = started
        try:
            self._run_batch(batch, chunks, started)
        finally:
            self._in_step = False
            self._step_started = None
            self._count_busy()

    def _drop_abandoned(self) -> None:
        """Throw CancelledError into every task about to step whose caller has gone: nothing
        more of it runs, and its key's next task starts (a close frees the blocks)."""
        dropping = True
        while dropping:  # a dropped task's key may start a next one, as abandoned
            dropping = False
            for running in list(self._active.values()):
                gone = running.gone
                if gone is not None and gone.is_set() and isinstance(running.waiting, Forward):
                    running.waiting = None
                    self.abandoned += 1
                    self._advance(running, None, CancelledError("the caller gave up the call"))
                    dropping = True

    _busy_since = 0.0
    _step_started: float | None = None
    """When the step running now began (None: none is running)."""

    def _count_busy(self) -> None:
        """Add the step's time so far to `busy_s`: when the step ends, and before it resolves a
        task's future, so that a caller never sees its call's compute missing from it."""
        now = self._clock()
        self.busy_s += now - self._busy_since
        self._busy_since = now

    def _wait_for_room(self) -> None:
        """Nothing could run (every ready task waits for blocks older sessions hold): wait
        for a call to arrive, or a little, rather than spin."""
        with self._condition:
            if not self._inbox and not self._stopped:
                self._condition.wait(ROOM_WAIT_S)

    def _preempt(self, seq_id: str) -> None:
        """Free `seq_id`'s KV blocks for an older session (the scheduler chose it): its
        session keeps its tokens and recomputes the KV on its next step; a task of it waiting
        on a Forward is told to plan its work again."""
        held = self.runner.length(seq_id)
        self.runner.truncate(seq_id, 0)
        sequences = set(self.runner.sequences())
        for gone in [s for s in self._to_recompute if s not in sequences]:
            del self._to_recompute[gone]  # closed before it ran again
        self.preemptions += 1
        self._to_recompute[seq_id] = self._to_recompute.get(seq_id, 0) + held
        logger.info("preempted sequence %r: %d cached tokens freed", seq_id, held)
        running = self._active.get(seq_id)
        if running is not None and isinstance(running.waiting, Forward):
            running.waiting = None
            self._advance(running, None, Preempted(f"sequence {seq_id!r} was preempted"))

    def _count_recomputed(self, chunks: Sequence[SequenceWork]) -> None:
        """Count the tokens of this step that rebuild KV a preemption freed."""
        for piece in chunks:
            owed = self._to_recompute.get(piece.seq_id)
            if owed is None:
                continue
            done = min(owed, len(piece.tokens))
            self.recomputed_tokens += done
            if owed > done:
                self._to_recompute[piece.seq_id] = owed - done
            else:
                del self._to_recompute[piece.seq_id]

    def _refuse(self, running: Running, blocks: int) -> None:
        error = PoolExhaustedError(
            f"the KV pool cannot hold this work: it needs {blocks} more blocks of "
            f"{self.runner.block_size} tokens, {self.runner.num_free_blocks} of "
            f"{self.runner.num_blocks} are free (held by other sessions); retry after "
            f"{RETRY_AFTER_S:g} s or on another replica",
            retry_after_s=RETRY_AFTER_S,
        )
        running.waiting = None
        self.refusals += 1
        self._advance(running, None, error)

    def _run_batch(self, batch: list[Running], chunks: list[SequenceWork], started: float) -> None:
        for running in batch:
            if not running.waited:
                running.waited = True
                self._queue_wait_s = smooth(self._queue_wait_s, started - running.submitted_at)
        tokens = sum(len(c.tokens) for c in chunks)
        if self._running:
            self.running_sessions += len(self._running)
            self.running_stepped += sum(r.key in self._running for r in batch)
        if self._to_recompute:
            self._count_recomputed(chunks)
        forward_started = self._clock()
        try:
            logits = self.runner.forward(chunks)
        except BaseException as error:  # a failed step fails its tasks, never the loop
            logger.exception("forward pass of %d sequences failed", len(batch))
            for running in batch:
                running.waiting = None
                self._advance(running, None, error)
            return
        finished = self._clock()
        self.forward_s += finished - forward_started
        elapsed = finished - started
        self._record(len(batch), tokens, elapsed)
        sizes = [len(c.logits_at) for c in chunks]
        rows = logits.split(sizes)
        # Greedy tasks get ids: every row's argmax in one call for the step.
        greedy = any(isinstance(r.waiting, Forward) and r.waiting.greedy for r in batch)
        best, finite = row_argmax(logits) if greedy else ([], [])
        resumed: list[tuple[Running, Any, BaseException | None]] = []
        start = 0
        for running, chunk, chunk_rows, size in zip(batch, chunks, rows, sizes, strict=True):
            running.done_tokens += len(chunk.tokens)
            waiting = running.waiting
            assert isinstance(waiting, Forward)
            if remaining(running) == 0 and not running.rows and waiting.greedy:
                ok = all(finite[start : start + size])
                resumed.append((running, best[start : start + size], None if ok else _not_finite()))
            else:
                running.rows.append(chunk_rows)
                if remaining(running) == 0:
                    resumed.append(_gathered(running))
            start += size
        for running, value, thrown in resumed:
            running.waiting = None
            self._advance(running, value, thrown)
        self._serve_batched()

    def _serve_batched(self) -> None:
        """Serve every task waiting on a Batched, one handler call per handler, until none
        waits (a task may yield another Batched after the first)."""
        while True:
            groups: dict[Any, list[Running]] = {}
            for running in self._active.values():
                if isinstance(running.waiting, Batched):
                    groups.setdefault(running.waiting.handler, []).append(running)
            if not groups:
                return
            for handler, group in groups.items():
                payloads = [r.waiting.payload for r in group]  # type: ignore[union-attr]
                handler_started = self._clock()
                try:
                    results = handler(payloads)
                    if len(results) != len(group):
                        raise RuntimeError("a batched handler returned the wrong number")
                except BaseException as failure:
                    results = [failure] * len(group)
                self.batched_s += self._clock() - handler_started
                for running, result in zip(group, results, strict=True):
                    running.waiting = None
                    value, thrown = _one([result])
                    self._advance(running, value, thrown)

    def _record(self, sequences: int, tokens: int, elapsed_s: float) -> None:
        self._steps += 1
        self._max_batch = max(self._max_batch, sequences)
        self._mean_batch = smooth(self._mean_batch, sequences, first=self._steps == 1)
        self._mean_tokens = smooth(self._mean_tokens, tokens, first=self._steps == 1)
        self._curve.observe(tokens, elapsed_s)
        base, per_token = self._curve.line()
        self._load = StepLoad(sequences, tokens, base, per_token)

    def _fail_all(self, error: BaseException) -> None:
        with self._condition:
            self._stopped = True
            pending = list(self._inbox)
            self._inbox.clear()
        pending += list(self._active.values()) + self._keyless
        pending += [r for queue in self._queued.values() for r in queue]
        self._active.clear()
        self._queued.clear()
        self._keyless.clear()
        self._running.clear()
        for running in pending:
            if running.future is not None and not running.future.done():
                running.future.set_exception(error)
                self._finished_any = True
            running.task.close()
        if threading.current_thread() is self._thread:
            self._notify_listeners()


def _not_finite() -> InvalidArgumentError:
    return InvalidArgumentError("a greedy row has NaN, +inf or no max")


def _gathered(running: Running) -> tuple[Running, Any, BaseException | None]:
    """A task's rows of a Forward run over several steps (chunked), as it asked for them."""
    gathered = running.rows[0] if len(running.rows) == 1 else torch.cat(running.rows)
    running.rows = []
    if not running.waiting.greedy:  # type: ignore[union-attr]
        return running, gathered, None
    try:
        return running, greedy_tokens(gathered), None
    except InvalidArgumentError as error:
        return running, None, error


def _one(results: list[Any]) -> tuple[Any, BaseException | None]:
    result = results[0]
    if isinstance(result, BaseException):
        return None, result
    return result, None
