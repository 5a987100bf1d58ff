"""Whether speculation pays for the router as a whole right now: measured, by alternating.

Pure arithmetic on a clock, no I/O. The per-request plan (`cluster.routing.draft_length`)
prices a block from one stream's view. Under concurrency that view misses what batching does:
sessions that only decode arrive at the verifier together and share every step, while
speculating sessions split between drafter and verifier, so each verify step carries fewer of
them and the drafter's own steps queue. On a machine where drafter and verifier share the
cores, the target alone can then commit more tokens per second than speculation does.

So while two or more requests run, the router measures it: it alternates epochs of
`epoch_s` seconds in which requests plan as usual (`speculate`) and in which every round is
the target alone (`target`), counting the tokens it commits in each; then it keeps the mode
that committed more per second for `exploit_epochs` epochs, and measures again (the load, the
text and the acceptance change). An epoch whose concurrency differs much from its rival's is
not compared: the exploration starts over. With one request the gate stays open: the
per-request plan sees all there is. While the gate holds the target alone, a request that starts
defers opening its drafter's session to its first round that may speculate
(`Router._session`): a short request that never speculates never pays the draft's prefill.

The router runs a second gate of this kind over outcome-keyed pre-drafting (`predraft_gate`):
among the requests that may pre-draft, epochs whose rounds pre-draft as the plan chooses
(`speculate`) against epochs whose rounds do not (`target`: plain pipelining or serial rounds,
as the plan prices them). On shared cores under load, the drafter's branches take CPU the
device model does not see; the gate keeps pre-drafting only while it commits more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

SPECULATE = "speculate"
TARGET = "target"


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    epoch_s: float = 4.0
    """Length of one measured epoch."""
    exploit_epochs: int = 6
    """Epochs the better mode runs before both are measured again."""


@dataclass
class _Epoch:
    mode: str
    started: float
    tokens: int = 0
    concurrency_s: float = 0.0
    """Requests running, integrated over the epoch (for its mean concurrency)."""


class SpeculationGate:
    """Alternates and compares speculation with the target alone (see the module docstring)."""

    def __init__(self, config: GateConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()  # the router's requests run on many threads
        self._running = 0
        self._last_change = clock()
        self._epoch = _Epoch(SPECULATE, clock())
        self._measured: dict[str, tuple[float, float]] = {}
        """Mode -> (tokens per second, mean concurrency) of its last explored epoch."""
        self._exploit_left = 0
        self.choice: str | None = None
        """The mode the last comparison chose (None: none yet)."""

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
        if now - self._epoch.started < self.config.epoch_s:
            return
        self._account()
        epoch, length_s = self._epoch, now - self._epoch.started
        rate, concurrency = epoch.tokens / length_s, epoch.concurrency_s / length_s
        if self._exploit_left > 0:
            self._exploit_left -= 1
            next_mode = epoch.mode if self._exploit_left > 0 else SPECULATE
            if self._exploit_left == 0:
                self._measured.clear()
        else:
            self._measured[epoch.mode] = (rate, concurrency)
            other = TARGET if epoch.mode == SPECULATE else SPECULATE
            if other not in self._measured:
                next_mode = other
            else:
                (spec_rate, spec_c), (target_rate, target_c) = (
                    self._measured[SPECULATE],
                    self._measured[TARGET],
                )
                if min(spec_c, target_c) < 1.5 or abs(spec_c - target_c) > 0.25 * max(
                    spec_c, target_c
                ):  # not comparable (load changed, or hardly concurrent): measure again
                    self._measured.clear()
                    next_mode = SPECULATE
                else:
                    self.choice = SPECULATE if spec_rate >= target_rate else TARGET
                    self._exploit_left = self.config.exploit_epochs
                    next_mode = self.choice
        self._epoch = _Epoch(next_mode, now)
