"""Engine tasks: what a task yields to the engine, and the engine's record of a running task.

A *task* is a generator that holds one call's logic (`cluster.runtime.engine`). It yields
what it needs next and is resumed with the answer:

- `Forward(work)`: logits for a `SequenceWork`; resumed with the rows (float32
  `[len(logits_at), vocab]`), or with the runner's error thrown in. With `greedy`, resumed
  with each row's argmax instead (a list of ints, taken for the whole step in one call, as a
  GPU would leave only the chosen ids to the host), or `InvalidArgumentError` thrown in when a
  row's maximum is not finite.
  A Forward marked `preemptible` may instead be answered with `Preempted` thrown in: the
  engine freed the sequence's KV blocks to let an older session run, and the task plans its
  work again (the whole sequence, recomputed).
- `Batched(handler, payload)`: served after a step together with every other task waiting on
  the same handler, by one call `handler([payload, ...])`; resumed with its own result (or
  exception).

`Running` is where one task stands: what it waits on, since when, and how much of a chunked
Forward has run. The engine thread alone reads and writes it: the scheduler
(`cluster.runtime.scheduler`) holds it and reads it to pack a step, the stepper
(`cluster.runtime.stepper`) drives it. Plain data, no threads, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cluster.runtime.block_runner import SequenceWork
from cluster.runtime.call_scope import Gone
from cluster.runtime.errors import InvalidArgumentError

R = TypeVar("R")
P = TypeVar("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Forward:
    """A task's request for logits: the rows of `work.logits_at`, after appending its tokens."""

    work: SequenceWork
    preemptible: bool = False
    """The task takes `Preempted` thrown in while it waits, and then yields its work again as
    planned from the KV left (none); otherwise the engine never frees its blocks under it."""
    greedy: bool = False
    """Resume with each row's argmax (ints), not the rows."""


class Preempted(Exception):
    """Thrown into a task waiting on a preemptible Forward: its sequence's KV blocks were freed
    for an older session's growth; plan the work again from what the KV holds now."""


@dataclass(frozen=True)
class Batched:
    """A task's request to be served with every other task yielding the same `handler` after
    this step: `handler(payloads)` returns one result or exception per payload, in order."""

    handler: Callable[[list[Any]], list[Any]]
    payload: Any


Task = Generator[Forward | Batched, Any, R]


def each_alone_if_refused(
    step: Callable[[list[P]], Sequence[T]], batch: list[P]
) -> list[T | Exception]:
    """A `Batched` handler's results: `step(batch)` in one call, the step's fast path; if it
    refuses the batch (`InvalidArgumentError`: one payload's bad logits or settings), each
    payload on its own, so that only the payloads at fault fail, with their error in their
    place. A batch of one re-raises (the engine gives the error to its task)."""
    try:
        return list(step(batch))
    except InvalidArgumentError:
        if len(batch) == 1:
            raise
    results: list[T | Exception] = []
    for payload in batch:
        try:
            results.extend(step([payload]))
        except InvalidArgumentError as error:
            results.append(error)
    return results


@dataclass(eq=False)
class Running:
    """A task the engine drives, and where it stands."""

    task: Task[Any]
    key: str | None
    future: Future[Any] | None
    """Its result's (None: nobody waits for it, a running session's own step)."""
    submitted_at: float
    waiting: Forward | Batched | None = None
    """What the task yielded last (None: not started)."""
    ready_since: float = 0.0
    """When it started waiting for its current Forward (the fairness order)."""
    done_tokens: int = 0
    """Tokens of the current Forward already run (chunked prefill)."""
    rows: list[torch.Tensor] = field(default_factory=list)
    """Logit rows of the current Forward gathered so far."""
    waited: bool = False
    """Its queue wait (submission to first step) has been counted."""
    closes: bool = False
    """It ends its key's session: nothing of the key comes back after it
    (`Scheduler.finished`)."""
    gone: Gone | None = None
    """Set when its caller has gone (`cluster.runtime.call_scope`): the task is dropped before
    it runs another step."""
