"""The engine thread's work: driving tasks and running steps, with the threading left out.

`Stepper` starts no thread and never waits; the engine (`cluster.runtime.engine`) calls it from
its loop only. It asks the `Scheduler` (`cluster.runtime.scheduler`) which task starts and what
a step carries, and counts in the engine's `EngineCounters` (`cluster.runtime.engine_counters`).

Driving. A task is resumed with its answer (or has an error thrown in) until it waits on a
Forward or finishes; a Batched it yields between steps is served at once, alone. A finished
task resolves its future (a running session's own step has none: a failure is logged) and its
key's next queued task starts. A keyless task runs between steps and may not run a Forward.
Before a step, every running key with no task gets its next one from its maker (`fill_running`);
a task that ends without a step is followed at once, up to `MAX_INSTANT_TASKS` in a row.

A step (`step`). Tasks whose caller has gone get CancelledError first (`abandoned`). The
scheduler packs the step: work that cannot fit in the whole KV pool is refused with a
`PoolExhaustedError` and a retry hint (`refusals`); a victim it preempts has its KV blocks freed
and a task of it waiting on a preemptible Forward gets `Preempted` and plans again (its session
recomputes the KV: `preemptions`, `recomputed_tokens`). One `runner.forward` runs every chunk
(`run_batch`); a task gets its rows once its whole Forward has run (greedy: each row's argmax,
one call for the step), then every task waiting on a Batched is served, one call per handler.
A failed forward pass fails the step's tasks, never the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from cluster.runtime.block_runner import ModelRunner, PoolExhaustedError, SequenceWork
from cluster.runtime.engine_counters import EngineCounters
from cluster.runtime.errors import CancelledError, InvalidArgumentError
from cluster.runtime.scheduler import Scheduler, remaining
from cluster.runtime.task import Batched, Forward, Preempted, Running
from cluster.runtime.token_choice import greedy_tokens, row_argmax

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
"""Retry hint sent with a refusal for lack of KV blocks."""
MAX_INSTANT_TASKS = 4
"""Tasks of a running key started in a row when each ends without a step."""


class Stepper:
    """Drives one engine's tasks and runs its steps (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        counters: EngineCounters,
        clock: Callable[[], float],
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.counters = counters
        self._clock = clock
        self._in_step = False
        self._busy_since = 0.0
        self._step_started: float | None = None
        """When the step running now began (None: none is running)."""
        self._finished_any = False
        """Some task finished since `take_finished` last asked."""

    def take_finished(self) -> bool:
        """Whether some task finished since the last ask (and forget it)."""
        finished, self._finished_any = self._finished_any, False
        return finished

    def step_running_s(self) -> float:
        """Seconds the step running now has taken so far (0: none); any thread may ask."""
        started = self._step_started  # one read: the engine thread may clear it meanwhile
        return 0.0 if started is None else max(0.0, self._clock() - started)

    # ------------------------------------------------------------------ driving tasks

    def admit(self, running: Running) -> None:
        """Hand a submitted task to the scheduler; start it if it is its key's to run now."""
        started = self.scheduler.admit(running)
        if started is not None:
            self._advance(started, None, None)

    def run_keyless(self) -> None:
        while (running := self.scheduler.next_keyless()) is not None:
            self._advance(running, None, None)

    def fill_running(self) -> None:
        """Start the next task of every running key that has none (`Scheduler.next_running`),
        up to `MAX_INSTANT_TASKS` in a row for a key whose tasks end without a step."""
        if not self.scheduler.num_running:
            return
        now = self._clock()
        for key in self.scheduler.running_keys():
            for _ in range(MAX_INSTANT_TASKS):
                running = self.scheduler.next_running(key, now)
                if running is None:
                    break
                self._advance(running, None, None)

    def fail_all(self, pending: list[Running], error: BaseException) -> None:
        """Fail `pending` and every task the scheduler holds with `error`, closing them."""
        for running in pending + self.scheduler.drain():
            if running.future is not None and not running.future.done():
                running.future.set_exception(error)
                self._finished_any = True
            running.task.close()

    def _advance(self, running: Running, value: Any, error: BaseException | None) -> None:
        """Resume a task with `value` (or throw `error` into it) until it waits on a Forward,
        or finishes; a Batched it yields is served at once when it is alone (between steps)."""
        while True:
            try:
                if error is not None:
                    request = running.task.throw(error)
                else:
                    request = running.task.send(value)
            except StopIteration as stop:
                self._finish(running, stop.value, None)
                return
            except BaseException as failure:  # the task's own error goes to its caller
                self._finish(running, None, failure)
                return
            value, error = None, None
            if isinstance(request, Forward):
                running.waiting = request
                running.ready_since = self._clock()
                running.done_tokens = 0
                running.rows = []
                if running.key is None:
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

    def _finish(self, running: Running, result: Any, failure: BaseException | None) -> None:
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
        following = self.scheduler.finished(running)
        if following is not None:
            self._advance(following, None, None)

    # ------------------------------------------------------------------ a step

    def step(self) -> bool:
        """Run one step: pack it, run its forward pass, resume its tasks, serve its Batched
        handlers. False when nothing could run (every ready task waits for blocks)."""
        self._drop_abandoned()
        started = self._clock()
        batch, chunks = self.scheduler.pack(self.runner, self._refuse, self._preempt)
        if not batch:
            return False
        self._in_step = True
        self._step_started = started
        self._busy_since = started
        try:
            self.run_batch(batch, chunks, started)
        finally:
            self._in_step = False
            self._step_started = None
            self._count_busy()
        return True

    def _drop_abandoned(self) -> None:
        """Throw CancelledError into every task about to step whose caller has gone: nothing
        more of it runs, and its key's next task starts (a close frees the blocks)."""
        dropping = True
        while dropping:  # a dropped task's key may start a next one, as abandoned
            dropping = False
            for running in list(self.scheduler.active.values()):
                gone = running.gone
                if gone is not None and gone.is_set() and isinstance(running.waiting, Forward):
                    running.waiting = None
                    self.counters.abandon()
                    self._advance(running, None, CancelledError("the caller gave up the call"))
                    dropping = True

    def _count_busy(self) -> None:
        """Add the step's time so far to `busy_s`: when the step ends, and before it resolves a
        task's future, so that a caller never sees its call's compute missing from it."""
        now = self._clock()
        self.counters.add_busy(now - self._busy_since)
        self._busy_since = now

    def _preempt(self, seq_id: str) -> None:
        """Free `seq_id`'s KV blocks for an older session (the scheduler chose it): its
        session keeps its tokens and recomputes the KV on its next step; a task of it waiting
        on a Forward is told to plan its work again."""
        held = self.runner.length(seq_id)
        self.runner.truncate(seq_id, 0)
        self.counters.preempted(seq_id, held, set(self.runner.sequences()))
        logger.info("preempted sequence %r: %d cached tokens freed", seq_id, held)
        running = self.scheduler.active.get(seq_id)
        if running is not None and isinstance(running.waiting, Forward):
            running.waiting = None
            self._advance(running, None, Preempted(f"sequence {seq_id!r} was preempted"))

    def _refuse(self, running: Running, blocks: int) -> None:
        error = PoolExhaustedError(
            f"the KV pool cannot hold this work: it needs {blocks} more blocks of "
            f"{self.runner.block_size} tokens, {self.runner.num_free_blocks} of "
            f"{self.runner.num_blocks} are free (held by other sessions); retry after "
            f"{RETRY_AFTER_S:g} s or on another replica",
            retry_after_s=RETRY_AFTER_S,
        )
        running.waiting = None
        self.counters.refuse()
        self._advance(running, None, error)

    def run_batch(self, batch: list[Running], chunks: list[SequenceWork], started: float) -> None:
        """Run the packed step's forward pass and resume its tasks (the step began at
        `started`)."""
        counters = self.counters
        for running in batch:
            if not running.waited:
                running.waited = True
                counters.waited(started - running.submitted_at)
        tokens = sum(len(c.tokens) for c in chunks)
        if self.scheduler.num_running:
            stepped = sum(self.scheduler.is_running(r.key) for r in batch if r.key is not None)
            counters.carried(self.scheduler.num_running, stepped)
        if counters.to_recompute:
            counters.recomputing(chunks)
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
        counters.add_forward(finished - forward_started)
        counters.stepped(len(batch), tokens, finished - started)
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
            for running in self.scheduler.active.values():
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
                self.counters.add_batched(self._clock() - handler_started)
                for running, result in zip(group, results, strict=True):
                    running.waiting = None
                    value, thrown = _one([result])
                    self._advance(running, value, thrown)


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
