"""The engine's scheduler: it owns the engine's tasks and decides what goes into a step and whom
a step waits for. A plain class (no thread, never waits), driven directly in tests and on the
engine thread by the `Stepper` (`cluster.runtime.stepper`) and the `Engine`; its collections
change only through its own methods, the others read them.

The tasks (`admit`, `finished`, `next_keyless`, `next_running`, `drain`). Each key (a session
id) has at most one *active* task; later ones of the key queue behind it in submission order
and become active one after another as each finishes. A task with no key waits in the keyless
queue and runs between steps. A running key (`keep_running`) has a maker of its next task,
asked whenever the key has no task active or queued; a maker that returns None is unregistered.

Packing (`pack`). Each step has a budget in tokens and in sequences. Small items (decodes, draft
steps, verify blocks: up to `SMALL_ITEM_TOKENS`) go first, oldest first; long items (prefill
chunks) fill what is left, the oldest always getting a share (`LONG_SHARE`). An item whose KV
blocks do not fit beside the others waits for the next step; one that cannot fit even alone
goes to the caller's `refuse` at once. Short of blocks, the step is packed oldest session first
and newer (or idle) sessions are handed to `preempt` to make room.

Gathering (`to_gather`). Sessions drift out of phase: one's next call arrives just after a step
started without it, and the batch splits into small alternating steps. A session whose calls
usually come back quickly after its last one finished (its smoothed return time) is expected
back when due within a share of the predicted step time (`GATHER_SHARE`, at most
`MAX_GATHER_S`); one slower than a step is not, one stream never waits, and one whose last task
closed it is forgotten (as is one gone a minute while too many are kept). The scheduler decides
whom to wait for and how long; the engine does the waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from cluster.runtime.block_runner import ModelRunner, SequenceWork
from cluster.runtime.cost_curve import smooth
from cluster.runtime.kv_pool import blocks_for
from cluster.runtime.limits import DEFAULT_MAX_STEP_SEQUENCES, DEFAULT_MAX_STEP_TOKENS, GATHER_SHARE
from cluster.runtime.task import Forward, Running, Task

SMALL_ITEM_TOKENS = 33
"""Items of up to this many tokens (a decode, a draft step, a verify block of up to 32 drafts)
are served before prefill chunks."""
LONG_SHARE = 4
"""The oldest long item always gets at least max_step_tokens // LONG_SHARE tokens of a step."""
MAX_GATHER_S = 0.05
IDLE_PREEMPT_S = 1.0
"""Under memory pressure a session idle this long (no call on it) may lose its KV blocks to
any session, older or not: its router is slow to come back, or gone until the idle TTL."""


class Scheduler:
    """The engine's tasks, the step budgets, the packing and gather decisions, and the
    return-time bookkeeping (see the module docstring)."""

    def __init__(
        self,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        max_step_sequences: int = DEFAULT_MAX_STEP_SEQUENCES,
        *,
        clock: Callable[[], float],
        gather_share: float = GATHER_SHARE,
    ) -> None:
        """`gather_share`: a step waits for sessions about to come back at most this share of
        its predicted time (0: never waits)."""
        self.max_step_tokens = max_step_tokens
        self.max_step_sequences = max_step_sequences
        self.gather_share = gather_share
        self._clock = clock
        self._active: dict[str, Running] = {}
        """Each key's task started and not finished."""
        self._queued: dict[str, deque[Running]] = {}
        """Each key's tasks waiting for its active one, in submission order."""
        self._num_queued = 0
        self._keyless: deque[Running] = deque()
        self._running: dict[str, Callable[[], Task[Any] | None]] = {}
        """Per running key, the maker of its next task (`keep_running`)."""
        self.finished_at: dict[str, float] = {}
        """When each key's last task finished (until its next arrives)."""
        self.return_s: dict[str, float] = {}
        """Each key's smoothed turnaround: from a task finishing to its next arriving."""

    # ------------------------------------------------------------------ the tasks

    @property
    def active(self) -> Mapping[str, Running]:
        """The active task of each key (read only: the scheduler changes it)."""
        return self._active

    @property
    def num_queued(self) -> int:
        """Keyed tasks waiting behind their key's active one."""
        return self._num_queued

    def active_keys(self) -> frozenset[str]:
        """Keys with a task active or queued."""
        return frozenset(self._active.keys() | self._queued.keys())

    def has_work(self) -> bool:
        """Whether a task is active or keyless (any thread may ask: a snapshot)."""
        return bool(self._active or self._keyless)

    def has_forward(self) -> bool:
        """Whether an active task waits on a Forward (a step has something to run)."""
        return any(isinstance(r.waiting, Forward) for r in self._active.values())

    def admit(self, running: Running) -> Running | None:
        """Take a submitted task: returned when it becomes its key's active task (the caller
        starts it), else None (queued behind its key's active task, or keyless)."""
        self._arrived(running)
        key = running.key
        if key is None:
            self._keyless.append(running)
            return None
        if key in self._active:
            self._queued.setdefault(key, deque()).append(running)
            self._num_queued += 1
            return None
        self._active[key] = running
        return running

    def next_keyless(self) -> Running | None:
        """The oldest keyless task, taken off its queue (None: none waits)."""
        return self._keyless.popleft() if self._keyless else None

    def finished(self, running: Running) -> Running | None:
        """A task finished: its key's next queued task, now active (the caller starts it), or
        None. Notes when the key's last task finished, for its return time."""
        key = running.key
        if key is None:
            return None
        del self._active[key]
        queue = self._queued.get(key)
        if running.closes:  # the session ended: waiting for it to come back would be for nothing
            self.finished_at.pop(key, None)
            self.return_s.pop(key, None)
        elif not queue:
            self.finished_at[key] = self._clock()
        if len(self.finished_at) > 4 * max(len(self._active), 64):  # sessions gone unclosed
            horizon = self._clock() - 60.0
            for gone in [k for k, t in self.finished_at.items() if t < horizon]:
                del self.finished_at[gone]
                self.return_s.pop(gone, None)
        if not queue:
            return None
        following = queue.popleft()
        self._num_queued -= 1
        if not queue:
            del self._queued[key]
        self._active[key] = following
        return following

    def keep_running(self, key: str, make: Callable[[], Task[Any] | None]) -> None:
        """`key` advances on its own: `make()` gives its next task (None: nothing more)."""
        self._running[key] = make

    def stop_running(self, key: str) -> None:
        """`key` no longer advances on its own (unknown keys: nothing)."""
        self._running.pop(key, None)

    def is_running(self, key: str) -> bool:
        return key in self._running

    @property
    def num_running(self) -> int:
        """Running keys registered now."""
        return len(self._running)

    def running_keys(self) -> list[str]:
        return list(self._running)

    def next_running(self, key: str, now: float) -> Running | None:
        """The running `key`'s next task, made active (the caller starts it), when the key has
        none active or queued; None otherwise, or when its maker has nothing more (the key is
        then unregistered)."""
        if key in self._active or key in self._queued:
            return None
        make = self._running.get(key)
        task = make() if make is not None else None
        if task is None:
            self._running.pop(key, None)
            return None
        running = Running(task, key, None, now)
        running.waited = True  # no caller queued it
        self._active[key] = running
        return running

    def drain(self) -> list[Running]:
        """Every task held (active, keyless, queued), forgotten with the running keys."""
        pending = [*self._active.values(), *self._keyless]
        pending += [r for queue in self._queued.values() for r in queue]
        self._active.clear()
        self._queued.clear()
        self._num_queued = 0
        self._keyless.clear()
        self._running.clear()
        return pending

    def _arrived(self, running: Running) -> None:
        """A task arrived: its gap since its key's last task finished updates the key's
        return time."""
        finished = self.finished_at.pop(running.key, None) if running.key is not None else None
        if finished is not None and running.key is not None:
            gap_s = running.submitted_at - finished
            old = self.return_s.get(running.key)
            self.return_s[running.key] = gap_s if old is None else smooth(old, gap_s)

    # ------------------------------------------------------------------ gathering

    def to_gather(self, predicted_step_s: float) -> tuple[set[str], float]:
        """The keys a step about to run should wait for, and the longest it may wait (s); no
        keys when the step is full already or nobody is about to come back.
        `predicted_step_s`: the cost curve at the usual step size."""
        active = self._active
        ready = sum(isinstance(r.waiting, Forward) for r in active.values())
        if ready >= self.max_step_sequences or self.gather_share <= 0:
            return set(), 0.0
        window_s = min(MAX_GATHER_S, self.gather_share * predicted_step_s)
        now = self._clock()
        expected = set()
        for key, finished in self.finished_at.items():
            return_s = self.return_s.get(key)
            if key in active or return_s is None or return_s > predicted_step_s:
                continue  # busy, never seen back, or slower than a step: not worth a wait
            due_in_s = finished + return_s - now
            if -window_s < due_in_s <= window_s:  # due within the window, not long overdue
                expected.add(key)
        return expected, window_s

    # ------------------------------------------------------------------ packing

    def pack(
        self,
        runner: ModelRunner,
        refuse: Callable[[Running, int], None],
        preempt: Callable[[str], None] | None = None,
    ) -> tuple[list[Running], list[SequenceWork]]:
        """Choose this step's items among the active tasks waiting on a Forward, under the
        budgets and `runner`'s free KV blocks: the tasks and the chunk each runs. A task that
        could not fit even alone goes to `refuse(task, blocks it needs)` at once.

        `preempt(seq_id)`: free a sequence's KV blocks (its session recomputes them later).
        Given, a step short of blocks is packed oldest session first and makes room by
        preempting newer sessions (`_pack_by_age`); a task is then refused only when it could
        not fit in the whole pool."""
        active = list(self._active.values())  # refuse and preempt may finish tasks
        ready = [r for r in active if isinstance(r.waiting, Forward)]
        small = sorted(
            (r for r in ready if remaining(r) <= SMALL_ITEM_TOKENS), key=lambda r: r.ready_since
        )
        long = sorted(
            (r for r in ready if remaining(r) > SMALL_ITEM_TOKENS), key=lambda r: r.ready_since
        )
        tokens_left = self.max_step_tokens
        if long:  # the oldest long item keeps a share of every step
            tokens_left -= self.max_step_tokens // LONG_SHARE
        free = runner.num_free_blocks
        batch: list[Running] = []
        chunks: list[SequenceWork] = []
        for position, running in enumerate([*small, *long]):
            if len(batch) >= self.max_step_sequences:
                break
            if position == len(small) and long:
                tokens_left += self.max_step_tokens // LONG_SHARE
            take = min(remaining(running), tokens_left)
            if take <= 0:
                continue
            piece = chunk(running, take)
            need = runner.blocks_needed(piece.seq_id, runner.length(piece.seq_id) + take)
            if need > free:
                alone = runner.blocks_needed(
                    piece.seq_id, runner.length(piece.seq_id) + remaining(running)
                )
                if alone > runner.num_free_blocks:
                    if preempt is not None:  # short of blocks: nothing is reserved yet
                        return self._pack_by_age(active, ready, runner, refuse, preempt)
                    refuse(running, alone)
                continue  # it fits alone: the next step
            free -= need
            tokens_left -= take
            batch.append(running)
            chunks.append(piece)
        return batch, chunks

    # ------------------------------------------------------------------ memory pressure

    def _pack_by_age(
        self,
        active: list[Running],
        ready: list[Running],
        runner: ModelRunner,
        refuse: Callable[[Running, int], None],
        preempt: Callable[[str], None],
    ) -> tuple[list[Running], list[SequenceWork]]:
        """Pack under memory pressure: the oldest session (the first to take blocks) first,
        each making room by preempting sessions newer than itself, newest first (they have
        the least to recompute), and sessions idle past `IDLE_PREEMPT_S` whatever their age.
        The oldest session can always take the whole pool, so every session finishes in turn;
        one that could not fit in the whole pool is refused. Prefill chunks get no share of
        their own here: age alone orders the step."""
        age = {seq_id: i for i, seq_id in enumerate(runner.sequences())}
        by_key = {r.key: r for r in active if r.key is not None}

        def rank(running: Running) -> tuple[int, float]:
            seq_id = running.waiting.work.seq_id  # type: ignore[union-attr]
            return age.get(seq_id, len(age)), running.ready_since

        batch: list[Running] = []
        chunks: list[SequenceWork] = []
        granted = 0  # blocks this step's items will reserve
        taken: set[str] = set()
        preempted: set[str] = set()
        tokens_left = self.max_step_tokens
        for running in sorted(ready, key=rank):
            if len(batch) >= self.max_step_sequences or tokens_left <= 0:
                break
            if not isinstance(running.waiting, Forward):
                continue  # preempted this step and failed, or done
            seq_id = running.waiting.work.seq_id
            if seq_id in preempted:
                continue  # it just gave its blocks up: not back in the same step
            take = min(remaining(running), tokens_left)
            piece = chunk(running, take)
            need = runner.blocks_needed(seq_id, runner.length(seq_id) + take)
            if need > runner.num_free_blocks - granted:
                lacking = need - (runner.num_free_blocks - granted)
                own_age = age.get(seq_id, len(age))
                victims = self._victims(runner, age, own_age, seq_id, taken, by_key, lacking)
                for victim in victims:
                    preempt(victim)
                    preempted.add(victim)
            if need > runner.num_free_blocks - granted:
                whole = runner.length(seq_id) + remaining(running)
                if blocks_for(whole, runner.block_size) > runner.num_blocks:
                    refuse(running, runner.blocks_needed(seq_id, whole))
                continue  # it waits for older sessions to finish
            granted += need
            tokens_left -= take
            taken.add(seq_id)
            batch.append(running)
            chunks.append(piece)
        return batch, chunks

    def _victims(
        self,
        runner: ModelRunner,
        age: Mapping[str, int],
        own_age: int,
        own: str,
        taken: set[str],
        by_key: Mapping[str, Running],
        lacking: int,
    ) -> list[str]:
        """Sequences whose blocks together cover `lacking`, newest first: newer than `own_age`
        (idle, or waiting on a preemptible Forward), or idle past `IDLE_PREEMPT_S`; none
        when all of them could not cover it (preempting then would only waste work)."""
        now = self._clock()
        chosen: list[str] = []
        freed = 0
        for seq_id in sorted(age, key=age.__getitem__, reverse=True):
            if freed >= lacking:
                break
            held = runner.num_blocks_of(seq_id)
            if seq_id == own or seq_id in taken or held == 0:
                continue
            running = by_key.get(seq_id)
            if running is not None:
                waiting = running.waiting
                movable = isinstance(waiting, Forward) and waiting.preemptible
                if not movable or age[seq_id] <= own_age:
                    continue
            elif age[seq_id] <= own_age:
                idle_since = self.finished_at.get(seq_id, -float("inf"))
                if now - idle_since < IDLE_PREEMPT_S:
                    continue  # an older session between two calls: it comes back soon
            chosen.append(seq_id)
            freed += held
        return chosen if freed >= lacking else []


def remaining(running: Running) -> int:
    """Tokens of a task's current Forward not run yet."""
    assert isinstance(running.waiting, Forward)
    return len(running.waiting.work.tokens) - running.done_tokens


def chunk(running: Running, take: int) -> SequenceWork:
    """The next `take` tokens of a task's Forward, with the logits that fall in them."""
    assert isinstance(running.waiting, Forward)
    work = running.waiting.work
    start, stop = running.done_tokens, running.done_tokens + take
    if start == 0 and stop == len(work.tokens):
        return work
    return SequenceWork(
        work.seq_id,
        tuple(work.tokens[start:stop]),
        tuple(i - start for i in work.logits_at if start <= i < stop),
    )
