"""The engine loop over a recording runner: batching, per-session order, chunked prefill,
budgets, KV admission, batched handlers, failures and figures.

The runner here is a plain bookkeeping double (no model): each logit row it returns encodes the
sequence and the position it was computed at, so the tests can see which tokens ran in which
step. The real runners are tested against the model in test_runner.py and through the
components in test_engine_components.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError

import pytest
import torch

from cluster.runtime.block_runner import SequenceWork
from cluster.runtime.call_scope import call_scope
from cluster.runtime.engine import Engine
from cluster.runtime.errors import CancelledError, ResourceExhaustedError
from cluster.runtime.task import Batched, Forward, Preempted, Task
from tests.cluster.runtime.fake_runner import VOCAB, RecordingRunner


def forward_task(seq_id: str, tokens: int, logits_at: Sequence[int]) -> Task[torch.Tensor]:
    rows = yield Forward(SequenceWork(seq_id, (1,) * tokens, tuple(logits_at)))
    return rows


@pytest.fixture
def runner() -> RecordingRunner:
    return RecordingRunner()


@pytest.fixture
def engine(runner: RecordingRunner) -> Iterator[Engine]:
    engine = Engine(runner, max_step_tokens=64, max_step_sequences=8)
    yield engine
    engine.stop()


def test_waiting_tasks_share_one_forward_pass(runner: RecordingRunner, engine: Engine) -> None:
    runner.gate = threading.Event()
    blocker = engine.submit(forward_task("first", 1, [0]), key="first")
    runner.entered.wait(timeout=10)
    futures = [engine.submit(forward_task(f"s{i}", 3, [0, 1, 2]), key=f"s{i}") for i in range(6)]
    runner.gate.set()
    blocker.result(timeout=10)
    results = [f.result(timeout=10) for f in futures]
    # The six arrived while the first step ran: they all went into the next one.
    assert [len(step) for step in runner.steps] == [1, 6]
    for rows in results:
        assert rows[:, 1].tolist() == [0.0, 1.0, 2.0]  # positions of the three logits
    stats = engine.stats()
    assert stats.steps == 2 and stats.max_batch_sequences == 6


def test_tasks_of_one_key_run_in_order(runner: RecordingRunner, engine: Engine) -> None:
    order: list[str] = []

    def task(name: str) -> Task[None]:
        yield Forward(SequenceWork("same", (1,), (0,)))
        order.append(name)

    futures = [engine.submit(task(f"t{i}"), key="same") for i in range(5)]
    for future in futures:
        future.result(timeout=10)
    assert order == ["t0", "t1", "t2", "t3", "t4"]
    assert all(len(step) == 1 for step in runner.steps)  # never two items of one sequence


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes(
    runner: RecordingRunner, engine: Engine
) -> None:
    runner.gate = threading.Event()
    long = engine.submit(forward_task("long", 200, [199]), key="long")
    decodes = [engine.submit(forward_task(f"d{i}", 1, [0]), key=f"d{i}") for i in range(3)]
    runner.gate.set()
    rows = long.result(timeout=10)
    assert rows[:, 1].tolist() == [199.0]  # the logit of the last chunk's last token
    for future in decodes:
        future.result(timeout=10)
    assert runner.length("long") == 200
    chunk_sizes = [len(w.tokens) for step in runner.steps for w in step if w.seq_id == "long"]
    assert sum(chunk_sizes) == 200 and len(chunk_sizes) >= 4  # 64-token steps at most
    assert all(sum(len(w.tokens) for w in step) <= 64 for step in runner.steps)
    first_long = next(i for i, s in enumerate(runner.steps) if any(w.seq_id == "long" for w in s))
    with_decodes = [i for i, s in enumerate(runner.steps) if any(w.seq_id[0] == "d" for w in s)]
    assert with_decodes and with_decodes[0] <= first_long + 1  # decodes did not wait it out


def test_the_step_sequence_budget_holds(runner: RecordingRunner) -> None:
    engine = Engine(runner, max_step_tokens=64, max_step_sequences=3)
    try:
        runner.gate = threading.Event()
        futures = [engine.submit(forward_task(f"s{i}", 1, [0]), key=f"s{i}") for i in range(10)]
        runner.gate.set()
        for future in futures:
            future.result(timeout=10)
    finally:
        engine.stop()
    assert max(len(step) for step in runner.steps) == 3


def test_work_that_cannot_fit_in_the_whole_pool_is_refused_with_a_retry_hint() -> None:
    runner = RecordingRunner(num_blocks=4, block_size=4)  # 16 tokens in all
    engine = Engine(runner)
    try:
        engine.run(forward_task("holder", 12, []), key="holder")  # 3 blocks held
        with pytest.raises(ResourceExhaustedError, match="KV pool") as refused:
            engine.run(forward_task("big", 20, [19]), key="big")
        assert refused.value.retry_after_s is not None
        assert engine.stats().refusals == 1 and engine.stats().preemptions == 0
        # The replica keeps serving: a sequence that fits still runs.
        assert engine.run(forward_task("small", 4, [3]), key="small").shape == (1, VOCAB)
    finally:
        engine.stop()


def replanning_task(
    runner: RecordingRunner, seq_id: str, total: int, plans: list[int]
) -> Task[torch.Tensor]:
    """A component's forward: run what the KV lacks of `total` tokens, and plan again when
    preempted (each plan's token count goes to `plans`)."""
    while True:
        tokens = total - runner.length(seq_id)
        plans.append(tokens)
        try:
            rows = yield Forward(SequenceWork(seq_id, (1,) * tokens, (tokens - 1,)), True)
        except Preempted:
            continue
        return rows


def test_a_newer_idle_session_is_preempted_for_an_older_ones_growth_and_recomputes() -> None:
    runner = RecordingRunner(num_blocks=4, block_size=4)  # 16 tokens in all
    engine = Engine(runner)
    try:
        engine.run(forward_task("old", 4, []), key="old")  # 1 block
        engine.run(forward_task("new", 8, []), key="new")  # 2 blocks, newer
        # The old session grows by 2 blocks: only 1 is free, so the new one gives up its KV.
        rows = engine.run(forward_task("old", 8, [7]), key="old")
        assert rows[0, 1].item() == 11.0  # position 11: the old KV was kept
        assert runner.length("new") == 0 and engine.stats().preemptions == 1
        # The new session's next call recomputes its 8 tokens before its own growth.
        engine.run(_release("old", runner), key="old")
        plans: list[int] = []
        rows = engine.run(replanning_task(runner, "new", 12, plans), key="new")
        assert plans == [12] and rows[0, 1].item() == 11.0
        assert engine.stats().recomputed_tokens == 8
    finally:
        engine.stop()


def _release(seq_id: str, runner: RecordingRunner) -> Task[None]:
    runner.release(seq_id)
    return
    yield


def test_a_waiting_newer_task_is_told_to_plan_again_when_preempted() -> None:
    runner = RecordingRunner(num_blocks=4, block_size=4)
    engine = Engine(runner)
    try:
        engine.run(forward_task("first", 3, []), key="first")  # 1 block, the oldest
        engine.run(forward_task("old", 4, []), key="old")  # 1 block
        engine.run(forward_task("new", 8, []), key="new")  # 2 blocks: the pool is full
        runner.gate = threading.Event()
        blocker = engine.submit(forward_task("first", 1, [0]), key="first")  # no new block
        runner.entered.wait(timeout=10)
        plans: list[int] = []
        # Both wait on the step in flight: the old one's growth needs the new one's blocks.
        new = engine.submit(replanning_task(runner, "new", 12, plans), key="new")
        old = engine.submit(forward_task("old", 4, [3]), key="old")
        runner.gate.set()
        blocker.result(timeout=10)
        assert old.result(timeout=10)[0, 1].item() == 7.0
        engine.run(_release("old", runner), key="old")
        assert new.result(timeout=10)[0, 1].item() == 11.0
        assert plans == [4, 12]  # its first plan assumed 8 cached tokens; preempted, all 12
        assert engine.stats().preemptions == 1
    finally:
        engine.stop()


def test_an_older_session_between_calls_keeps_its_blocks_until_it_idles() -> None:
    runner = RecordingRunner(num_blocks=4, block_size=4)
    engine = Engine(runner)
    try:
        engine.run(forward_task("old", 12, []), key="old")  # 3 blocks, just used
        started = time.monotonic()
        engine.run(forward_task("new", 8, [7]), key="new")  # needs 2: waits for the old one
        waited = time.monotonic() - started
        assert runner.length("old") == 0 and engine.stats().preemptions == 1
        assert waited >= 0.5  # not taken at once: an older session comes back soon
    finally:
        engine.stop()


def test_batched_handlers_see_every_waiting_payload_at_once(
    runner: RecordingRunner, engine: Engine
) -> None:
    calls: list[list[int]] = []

    def double(payloads: list[int]) -> list[object]:
        calls.append(list(payloads))
        return [ValueError("odd") if p % 2 else p * 2 for p in payloads]

    def task(seq_id: str, value: int) -> Task[int]:
        yield Forward(SequenceWork(seq_id, (1,), (0,)))
        doubled: int = yield Batched(double, value)
        return doubled

    runner.gate = threading.Event()
    futures = [engine.submit(task(f"s{i}", i), key=f"s{i}") for i in range(4)]
    runner.gate.set()
    assert futures[0].result(timeout=10) == 0 and futures[2].result(timeout=10) == 4
    for odd in (futures[1], futures[3]):  # s3 may run a step after the others: wait for it
        with pytest.raises(ValueError, match="odd"):
            odd.result(timeout=10)
    assert sum(len(c) for c in calls) == 4 and len(calls) <= 2  # grouped per step


def test_a_failed_step_fails_its_tasks_and_the_engine_goes_on(
    runner: RecordingRunner, engine: Engine
) -> None:
    runner.fail_next = True
    with pytest.raises(RuntimeError, match="fell over"):
        engine.run(forward_task("a", 2, [1]), key="a")
    assert engine.run(forward_task("b", 2, [1]), key="b").shape == (1, VOCAB)


def test_keyless_calls_run_between_steps_and_errors_reach_the_caller(engine: Engine) -> None:
    assert engine.call(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 // 0)


def test_stop_fails_what_is_waiting(runner: RecordingRunner) -> None:
    engine = Engine(runner)
    runner.gate = threading.Event()
    running = engine.submit(forward_task("a", 1, [0]), key="a")
    waiting = engine.submit(forward_task("a", 1, [0]), key="a")
    engine.stop(timeout_s=0)
    runner.gate.set()
    with pytest.raises(RuntimeError, match="stopped"):
        waiting.result(timeout=10)
    running.exception(timeout=10)  # the step in progress finishes or fails, never hangs
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit(forward_task("b", 1, [0]))


def test_figures_and_cost_curve(runner: RecordingRunner, engine: Engine) -> None:
    engine.calibrate(token_counts=(1, 8, 32), repeats=2)
    stats = engine.stats()
    assert stats.steps == 6 and stats.kv_blocks_used == 0  # the scratch sequence is gone
    assert stats.cost_base_s >= 0 and stats.cost_per_token_s >= 0
    load = engine.step_load()
    assert load is not None and load.batch_sequences == 1 and load.batch_tokens == 32
    assert stats.kv_blocks_total == runner.num_blocks and stats.block_size == runner.block_size


def test_sessions_that_come_back_quickly_are_gathered_into_one_step(
    runner: RecordingRunner, engine: Engine
) -> None:
    # Two decode loops out of phase: without gathering, each step would take one of them and
    # the two would alternate in steps of one.
    runner.step_s = 0.02

    def decode_loop(seq_id: str) -> None:
        for _ in range(15):
            engine.run(forward_task(seq_id, 1, [0]), key=seq_id)
            time.sleep(0.002)  # the client's turnaround (a router's gRPC round trip)

    first = threading.Thread(target=decode_loop, args=("a",))
    first.start()
    runner.entered.wait(timeout=10)  # "b" starts while a step of "a" runs
    second = threading.Thread(target=decode_loop, args=("b",))
    second.start()
    first.join(timeout=30)
    second.join(timeout=30)
    sizes = [len(step) for step in runner.steps]
    assert sum(sizes) == 30
    assert len(sizes) <= 22  # mostly steps of both; alternating would take 30


class FrozenClock:
    """A clock that moves only when a step runs: a gather window never runs out on its own, so
    a step that waits for a session waits until that session comes back."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedRunner(RecordingRunner):
    """Each forward pass takes `STEP_S` of the frozen clock's time (and none of the wall's)."""

    STEP_S = 0.1

    def __init__(self, clock: FrozenClock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor:
        self.clock.now += self.STEP_S
        return super().forward(batch)


@pytest.mark.parametrize("last_call_closes", [False, True])
def test_a_step_waits_for_a_session_that_comes_back_but_not_for_one_closed(
    last_call_closes: bool,
) -> None:
    clock = FrozenClock()
    runner = ClockedRunner(clock)
    engine = Engine(runner, max_step_tokens=64, max_step_sequences=8, clock=clock)
    try:
        # "a" comes back at once after each call (no clock time passes): a step expects it.
        for _ in range(3):
            engine.run(forward_task("a", 1, [0]), key="a")
        if last_call_closes:
            engine.call(lambda: runner.release("a"), key="a", closes=True)
        other = engine.submit(forward_task("b", 1, [0]), key="b")
        if last_call_closes:
            # Nothing of "a" will come back: "b" steps at once. (Waiting for "a" on this clock
            # would never end.)
            other.result(timeout=10)
            assert [w.seq_id for w in runner.steps[-1]] == ["b"]
        else:
            with pytest.raises(FutureTimeoutError):  # the step waits for "a"...
                other.result(timeout=0.2)
            engine.run(forward_task("a", 1, [0]), key="a")
            other.result(timeout=10)
            # ...which joins it: one step of both.
            assert sorted(w.seq_id for w in runner.steps[-1]) == ["a", "b"]
    finally:
        engine.stop()


def test_a_task_whose_caller_has_gone_is_dropped_before_its_step(
    runner: RecordingRunner, engine: Engine
) -> None:
    runner.gate = threading.Event()
    blocker = engine.submit(forward_task("first", 1, [0]), key="first")
    assert runner.entered.wait(timeout=10)
    gone = threading.Event()
    with call_scope(gone):  # as a replica's handler thread submits a call
        abandoned = engine.submit(forward_task("abandoned", 3, [2]), key="abandoned")
        after = engine.submit(forward_task("abandoned", 1, [0]), key="abandoned")
    kept = engine.submit(forward_task("kept", 2, [1]), key="kept")
    gone.set()  # the caller goes while the first step runs
    runner.gate.set()
    blocker.result(timeout=10)
    assert kept.result(timeout=10).shape[0] == 1
    with pytest.raises(CancelledError, match="gave up"):
        abandoned.result(timeout=10)
    with pytest.raises(CancelledError):
        after.result(timeout=10)  # the key's next call, from the same caller, goes too
    ran = {work.seq_id for step in runner.steps for work in step}
    assert "abandoned" not in ran and "kept" in ran
    assert engine.counters.abandoned == 2


def test_step_listeners_run_once_per_step_after_its_done_callbacks(
    runner: RecordingRunner, engine: Engine
) -> None:
    events: list[str] = []

    def listener() -> None:
        assert engine.on_engine_thread
        events.append("listener")

    engine.add_step_listener(listener)
    runner.gate = threading.Event()
    blocker = engine.submit(forward_task("first", 1, [0]), key="first")
    runner.entered.wait(timeout=10)
    futures = [engine.submit(forward_task(f"s{i}", 1, [0]), key=f"s{i}") for i in range(4)]
    for future in futures:
        future.add_done_callback(lambda _: events.append("done"))
    runner.gate.set()
    blocker.result(timeout=10)
    for future in futures:
        future.result(timeout=10)
    give_up = time.monotonic() + 10
    while events[-1:] != ["listener"] and time.monotonic() < give_up:
        time.sleep(0.01)  # the step's listener runs just after its futures resolve
    # The first step's task, then the four of the next step: their callbacks, the listener once.
    assert events == ["listener"] + ["done"] * 4 + ["listener"]
    engine.remove_step_listener(listener)
    count = events.count("listener")
    engine.run(forward_task("after", 1, [0]), key="after")
    engine.call(lambda: None)  # one more loop iteration, after the step's
    assert events.count("listener") == count  # removed: never called again
