"""An engine's counters in one record: what it counts as it runs, and its snapshot.

`EngineCounters` is written by the engine thread alone (`cluster.runtime.engine`,
`cluster.runtime.stepper`), each change through one of its methods; any thread may read a
field, or take `snapshot`, the `EngineStats` a replica reports (`cluster.runtime.engine_stats`).
It counts steps, the largest batch, tokens and sessions per step (smoothed), queue wait, the
split of the engine's time (`busy_s`, `forward_s`, `batched_s`, `gather_s`, `gathers`), calls
dropped because their caller had gone (`abandoned`), preemptions and the tokens they cost again
(`recomputed_tokens`), refusals, and how many running sessions each step carried
(`running_stepped` of `running_sessions`). It holds the step cost curve
(`cluster.runtime.cost_curve`, seeded by `Engine.calibrate`) and the load of the last step
(`StepLoad`), which the router uses to price speculation under load. No I/O, no threads.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cluster.runtime.block_runner import ModelRunner, SequenceWork
from cluster.runtime.cost_curve import CostCurve, smooth
from cluster.runtime.draft_block import StepLoad
from cluster.runtime.engine_stats import EngineStats


@dataclass
class EngineCounters:
    """An engine's counters since start, its cost curve and its last step's load."""

    steps: int = 0
    max_batch: int = 0
    mean_batch: float = 0.0
    """Sessions per step, smoothed."""
    mean_tokens: float = 0.0
    """Tokens per step, smoothed."""
    queue_wait_s: float = 0.0
    """Seconds from a call's submission to its first step, smoothed."""
    busy_s: float = 0.0
    """Seconds in steps (counted before a step resolves a future: `add_busy`)."""
    forward_s: float = 0.0
    """Seconds of those in the runner's forward passes."""
    batched_s: float = 0.0
    """Seconds in Batched handlers (a verifier's acceptance)."""
    gather_s: float = 0.0
    """Seconds waiting for sessions about to come back, over `gathers` steps."""
    gathers: int = 0
    abandoned: int = 0
    """Tasks dropped because their caller had gone."""
    preemptions: int = 0
    """Sequences whose KV blocks were freed for an older session's growth."""
    recomputed_tokens: int = 0
    """Tokens run again to rebuild KV that preemptions freed."""
    refusals: int = 0
    """Tasks failed because their work could not fit in the whole KV pool."""
    running_sessions: int = 0
    """Running sessions registered, summed over the steps."""
    running_stepped: int = 0
    """Of those, the ones each step carried (`EngineStats.occupancy` is the ratio)."""
    startup_line: tuple[float, float] = (0.0, 0.0)
    """The cost curve as `calibrate` measured it before serving: (base_s, per_token_s)."""
    curve: CostCurve = field(default_factory=CostCurve)
    load: StepLoad | None = None
    """The load of the step that ran last."""
    to_recompute: dict[str, int] = field(default_factory=dict)
    """Per preempted sequence, the freed tokens not run again yet."""

    def stepped(self, sequences: int, tokens: int, elapsed_s: float) -> None:
        """A step of `sequences` and `tokens` ran in `elapsed_s`."""
        self.steps += 1
        self.max_batch = max(self.max_batch, sequences)
        self.mean_batch = smooth(self.mean_batch, sequences, first=self.steps == 1)
        self.mean_tokens = smooth(self.mean_tokens, tokens, first=self.steps == 1)
        self.curve.observe(tokens, elapsed_s)
        base, per_token = self.curve.line()
        self.load = StepLoad(sequences, tokens, base, per_token)

    def waited(self, wait_s: float) -> None:
        """A call reached its first step `wait_s` after its submission."""
        self.queue_wait_s = smooth(self.queue_wait_s, wait_s)

    def carried(self, registered: int, stepped: int) -> None:
        """A step carried `stepped` of the `registered` running sessions."""
        self.running_sessions += registered
        self.running_stepped += stepped

    def add_busy(self, seconds: float) -> None:
        self.busy_s += seconds

    def add_forward(self, seconds: float) -> None:
        self.forward_s += seconds

    def add_batched(self, seconds: float) -> None:
        self.batched_s += seconds

    def gathering(self) -> None:
        """A step waits for sessions about to come back (`add_gather` adds how long)."""
        self.gathers += 1

    def add_gather(self, seconds: float) -> None:
        self.gather_s += seconds

    def abandon(self) -> None:
        """A task was dropped: its caller had gone."""
        self.abandoned += 1

    def refuse(self) -> None:
        """A task failed: its work could not fit in the whole KV pool."""
        self.refusals += 1

    def preempted(self, seq_id: str, held: int, live: Collection[str]) -> None:
        """`seq_id`'s `held` cached tokens were freed; `live`: the sequences the runner holds
        (owed tokens of the others are forgotten: closed before they ran again)."""
        for gone in [s for s in self.to_recompute if s not in live]:
            del self.to_recompute[gone]
        self.preemptions += 1
        self.to_recompute[seq_id] = self.to_recompute.get(seq_id, 0) + held

    def recomputing(self, chunks: Sequence[SequenceWork]) -> None:
        """Count the tokens of this step's `chunks` that rebuild KV a preemption freed."""
        for piece in chunks:
            owed = self.to_recompute.get(piece.seq_id)
            if owed is None:
                continue
            done = min(owed, len(piece.tokens))
            self.recomputed_tokens += done
            if owed > done:
                self.to_recompute[piece.seq_id] = owed - done
            else:
                del self.to_recompute[piece.seq_id]

    def calibrated(self) -> None:
        """Keep the cost curve as measured now, before serving, as the start-up line."""
        self.startup_line = self.curve.line()

    def predicted_step_s(self) -> float:
        """The cost curve at the usual step size (smoothed tokens per step)."""
        base, per_token = self.curve.line()
        return base + per_token * self.mean_tokens

    def snapshot(self, runner: ModelRunner, *, queued: int, step_running_s: float) -> EngineStats:
        """The figures a replica reports: these counters, `runner`'s KV pool, the calls
        `queued` now and how long the step running now has taken."""
        base, per_token = self.curve.line()
        return EngineStats(
            runner=runner.kind,
            steps=self.steps,
            max_batch_sequences=self.max_batch,
            kv_blocks_total=runner.num_blocks,
            kv_blocks_used=runner.num_blocks - runner.num_free_blocks,
            block_size=runner.block_size,
            batch_sequences=self.mean_batch,
            step_tokens=self.mean_tokens,
            queue_wait_s=self.queue_wait_s,
            queued=queued,
            cost_base_s=base,
            cost_per_token_s=per_token,
            busy_s=self.busy_s,
            step_running_s=step_running_s,
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
