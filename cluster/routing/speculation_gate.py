"""Whether speculation pays for the router as a whole right now: measured, by alternating.

Pure arithmetic on a clock, no I/O. The per-request plan (`cluster.routing.draft_length`)
prices a block from one stream's view. Under concurrency that view misses what batching does:
sessions that only decode arrive at the verifier together and share every step, while
speculating sessions split between drafter and verifier, so each verify step carries fewer of
them and the drafter's own steps queue. On a machine where drafter and verifier share the
cores, the target alone can then commit more tokens per second than speculation does.

So while two or more requests run, the router measures it. It explores: one epoch in which
requests plan as usual (`speculate`) and one in which every round is the target alone
(`target`), counting the tokens it commits in each; then it exploits the mode that committed
more per second for `exploit_s` seconds, and explores again (the load, the text and the
acceptance change). An epoch lasts until it has committed `epoch_tokens` tokens (at least
`min_epoch_s`, at most `epoch_s` seconds): under load, where a wrong mode costs most, the gate
decides within a few seconds; with few slow streams it waits for tokens enough to compare.
Each time an exploration confirms the mode exploited before it, the next exploitation lasts
twice as long (up to `2**max_doublings` times `exploit_s`), so a settled choice costs little
exploring.

Load changes what pays, so the gate keeps the last choice for each level of concurrency (in
half octaves: 16 and 22 streams are different levels) and compares only epochs whose mean
concurrency is alike (within `band`). When the load moves to another level, during an
exploration or an exploitation, the gate exploits what it knows of the new level at once, for
`exploit_s`, and explores only where it knows nothing: the choice made at that level, else the
target alone where it was chosen at a lower level (more streams make speculation pay less:
batching already fills the verifier), else speculation where it was chosen at a higher level.
With one request the gate stays open: the per-request plan sees all there is. While the gate
holds the target alone, a request that starts defers opening its drafter's session to its first
round that may speculate (`Router._session`): a short request that never speculates never pays
the draft's prefill.

The router runs a second gate of this kind over outcome-keyed pre-drafting (`predraft_gate`):
among the requests that may pre-draft, epochs whose rounds pre-draft as the plan chooses
(`speculate`) against epochs whose rounds do not (`target`: plain pipelining or serial rounds,
as the plan prices them). On shared cores under load, the drafter's branches take CPU the
device model does not see; the gate keeps pre-drafting only while it commits more.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

SPECULATE = "speculate"
TARGET = "target"

MIN_CONCURRENCY = 1.5
"""Below this mean concurrency an epoch says nothing (the gate is open for one request)."""


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    epoch_s: float = 4.0
    """Longest measured epoch."""
    min_epoch_s: float = 1.0
    """Shortest measured epoch."""
    epoch_tokens: int = 512
    """Tokens committed that end an epoch (once it has lasted `min_epoch_s`)."""
    exploit_s: float = 24.0
    """How long the better mode runs before both are measured again (at first)."""
    max_doublings: int = 3
    """How often a confirmed choice doubles its next exploitation."""
    band: float = 0.25
    """Epochs whose mean concurrency differs by more than this share are not alike."""


@dataclass
class _Epoch:
    mode: str
    started: float
    tokens: int = 0
    concurrency_s: float = 0.0
    """Requests running, integrated over the epoch (for its mean concurrency)."""


@dataclass
class _Measured:
    """One ended epoch: its mode, committed tokens per second and mean concurrency."""

    mode: str
    rate: float
    concurrency: float


def level_of(concurrency: float) -> int:
    """The concurrency level a choice is kept for: half octaves (16 -> 8, 22 -> 9, 64 -> 12)."""
    return round(2 * math.log2(max(concurrency, 1.0)))


def alike(a: float, b: float, band: float) -> bool:
    """Whether two mean concurrencies are close enough to compare their epochs."""
    return abs(a - b) <= band * max(a, b)


@dataclass
class _Choices:
    """The last choice made at each concurrency level, and what it implies for another."""

    by_level: dict[int, str] = field(default_factory=dict)

    def known(self, concurrency: float) -> str | None:
        level = level_of(concurrency)
        if level in self.by_level:
            return self.by_level[level]
        # The nearest level whose choice carries over: the target alone from below (more
        # streams: speculation pays less), speculation from above.
        nearest: tuple[int, str] | None = None
        for other, mode in self.by_level.items():
            carries = (mode == TARGET and other < level) or (mode == SPECULATE and other > level)
            if carries and (nearest is None or abs(other - level) < abs(nearest[0] - level)):
                nearest = (other, mode)
        return None if nearest is None else nearest[1]


class SpeculationGate:
    """Alternates and compares speculation with the target alone (see the module docstring)."""

    def __init__(self, config: GateConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()  # the router's requests run on many threads
        self._running = 0
        self._last_change = clock()
        self._epoch = _Epoch(SPECULATE, clock())
        self._explored: list[_Measured] = []
        """The epochs of the exploration under way (empty: none yet, or exploiting)."""
        self._exploit_until: float | None = None
        """While exploiting: when to explore again."""
        self._exploit_concurrency: float | None = None
        """While exploiting: the concurrency it was chosen for (None: its first epoch's)."""
        self._doublings = 0
        self._choices = _Choices()
        self.choice: str | None = None
        """The mode the last exploration or known level chose (None: none yet)."""

    def request_started(self) -> None:
        with self._lock:
            self._account()
            self._running += 1

    def request_ended(self) -> None:
        with self._lock:
            self._account()
            self._running = max(0, self._running - 1)

    def committed(self, tokens: int) -> None:
        """Count tokens the router committed (any request)."""
        with self._lock:
            self._epoch.tokens += tokens

    def speculate(self) -> bool:
        """Whether a round planned now may speculate."""
        if not self.config.enabled:
            return True
        with self._lock:
            self._advance()
            return self._running < 2 or self._epoch.mode == SPECULATE

    def holds_target(self) -> bool:
        """Whether rounds planned now run the target alone for a while: a request starting
        now need not open its drafter's session until a round may speculate."""
        if not self.config.enabled:
            return False
        with self._lock:
            self._advance()
            return self._running >= 2 and self._epoch.mode == TARGET

    def _account(self) -> None:
        now = self._clock()
        self._epoch.concurrency_s += self._running * (now - self._last_change)
        self._last_change = now

    def _advance(self) -> None:
        now = self._clock()
        config, epoch = self.config, self._epoch
        length_s = now - epoch.started
        if length_s < config.min_epoch_s or (
            length_s < config.epoch_s and epoch.tokens < config.epoch_tokens
        ):
            return
        self._account()
        ended = _Measured(epoch.mode, epoch.tokens / length_s, epoch.concurrency_s / length_s)
        self._epoch = _Epoch(self._next_mode(ended, now), now)

    def _next_mode(self, ended: _Measured, now: float) -> str:
        if ended.concurrency < MIN_CONCURRENCY:  # hardly concurrent: nothing to learn
            return self._restart(self._running, now)
        if self._exploit_until is not None:
            return self._exploiting(ended, now)
        if self._explored and not alike(
            ended.concurrency, self._explored[0].concurrency, self.config.band
        ):  # the load moved during the exploration: start over at its level
            return self._restart(ended.concurrency, now)
        self._explored.append(ended)
        modes = {measured.mode: measured for measured in self._explored}
        if len(modes) < 2:
            return TARGET if ended.mode == SPECULATE else SPECULATE
        choice = SPECULATE if modes[SPECULATE].rate >= modes[TARGET].rate else TARGET
        confirmed = choice == self.choice
        self._doublings = min(self._doublings + 1, self.config.max_doublings) if confirmed else 0
        self._choices.by_level[level_of(ended.concurrency)] = choice
        return self._exploit(choice, ended.concurrency, now)

    def _exploiting(self, ended: _Measured, now: float) -> str:
        assert self._exploit_until is not None and self.choice is not None
        if self._exploit_concurrency is None:
            self._exploit_concurrency = ended.concurrency
        elif not alike(ended.concurrency, self._exploit_concurrency, self.config.band):
            return self._restart(ended.concurrency, now)  # the load moved
        if now < self._exploit_until:
            return self.choice
        # Explore again: the other mode first, then the choice (fresh, right after it).
        self._exploit_until = self._exploit_concurrency = None
        self._explored = []
        return TARGET if self.choice == SPECULATE else SPECULATE

    def _restart(self, concurrency: float, now: float) -> str:
        """The load is new: exploit what is known of its level, else explore it."""
        self._explored = []
        known = self._choices.known(concurrency) if concurrency >= MIN_CONCURRENCY else None
        if known is None:
            self._exploit_until = self._exploit_concurrency = None
            return SPECULATE
        self._doublings = 0
        return self._exploit(known, None, now)

    def _exploit(self, choice: str, concurrency: float | None, now: float) -> str:
        self.choice = choice
        self._explored = []
        self._exploit_until = now + self.config.exploit_s * 2**self._doublings
        self._exploit_concurrency = concurrency
        return choice
