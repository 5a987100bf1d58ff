"""Which drafting pays for one request, by its own committed tokens per second: never below the
target alone, on measurement.

Pure arithmetic, no I/O. The adaptive plan (`cluster.routing.goodput`) prices a block from
modelled latencies; on a machine where the drafter and the verifier share the cores, or where a
verify pass of k + 1 tokens costs nearly k + 1 single steps (bfloat16 on a CPU without native
bfloat16 arithmetic), its model can be wrong, and a request would then speculate into a loss.
So each request also measures what it gets. Its rounds run in one of three modes:

- `MODEL`: the plan's rounds (the suffix drafter, prompt lookup, the draft model);
- `LOOKUP`: blocks that cost no model (the suffix drafter and prompt lookup) and none from the
  draft model;
- `ALONE`: the target alone, nothing drafted.

Every stretch between two of the verifier's reports is counted, tokens and seconds, to the mode
its round was planned in (decayed by `decay` per stretch). The target alone's rate starts from
the verifier's own measured step (`seed_alone`: its start-up calibration, worth `seed_tokens`
tokens) until the request has timed a trial of it.

A mode runs a trial of `trial_tokens` committed tokens; then the request moves to a mode whose
measurement is due, if any, else to the mode with the best measured rate (a speculating mode
must beat the one below it by `margin`; on a tie, the one that speculates less), so
speculation is kept only while it commits more than the target alone. A mode that loses is
measured again after `retry_tokens` more committed tokens, times how many times slower it was,
twice as many after each further loss (up to `max_retry_tokens`): a wrong mode costs a bounded
share of any request, and a change in the text or the load is found again. Each is measured at
the start, in that order (the target alone only where nothing seeds it), except a draft model
that the replicas' start-up measurement rules out (`model_pays`): it is first measured after
`max_retry_tokens`, as a check on that measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODEL = "model"
LOOKUP = "lookup"
ALONE = "alone"
MODES = (MODEL, LOOKUP, ALONE)
"""From the most speculation to none: a losing mode steps down this order."""


@dataclass(frozen=True)
class ModesConfig:
    enabled: bool = True
    trial_tokens: int = 8
    """Committed tokens a mode runs before the request decides again."""
    retry_tokens: int = 32
    """Committed tokens before a mode that lost is measured again (doubling per loss, and
    times how many times slower than the best it measured)."""
    max_retry_tokens: int = 384
    decay: float = 0.9
    """Weight kept by a mode's past tokens and seconds per stretch counted to it."""
    seed_tokens: float = 4.0
    """What the seeded target-alone rate weighs, in tokens, against the request's own."""
    margin: float = 0.05
    """How much faster than the mode below it a speculating mode must measure to be kept
    (trials of a few tokens are noisy, and a tie goes to the one that speculates less)."""


@dataclass
class _Tally:
    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.tokens > 0 and self.seconds > 0 else None


@dataclass
class DraftModes:
    """One request's mode, and the measured rates that choose it."""

    config: ModesConfig = field(default_factory=ModesConfig)
    model_pays: bool = True
    """False: the start-up measurement says the draft model cannot pay on these replicas."""
    draft_ratio: float | None = None
    """The drafter's measured one-token step over the verifier's (None: not known)."""

    def __post_init__(self) -> None:
        self._tallies = {mode: _Tally() for mode in MODES}
        self._alone_seed_s: float | None = None
        self._committed = 0.0
        self._since = 0.0
        """Tokens committed in the present mode since it was chosen."""
        retry = float(self.config.retry_tokens)
        self._wait = dict.fromkeys(MODES, retry)
        first = MODEL if self.model_pays else LOOKUP
        self._due_at = dict.fromkeys(MODES, 0.0)
        """When each mode is to be measured (again), in committed tokens."""
        if not self.model_pays:  # tried only in a long request, as a check on the measurement
            self._due_at[MODEL] = float(self.config.max_retry_tokens)
        self.mode = first
        self.reason = "the plan's blocks"
        if not self.model_pays:
            cost = "" if self.draft_ratio is None else f" ({self.draft_ratio:.2f} of a target step)"
            self.reason = f"model off: the draft's measured step{cost} cannot pay here"

    def seed_alone(self, step_s: float) -> None:
        """The target alone's seconds per token as the verifier measured its step (ignored
        where not positive): no trial of the target alone is due at the start."""
        if step_s > 0:
            self._alone_seed_s = step_s
            if self._tallies[ALONE].rate is None:
                self._due_at[ALONE] = float(self.config.retry_tokens)

    def rate(self, mode: str) -> float | None:
        """Measured tokens per second of `mode` (the target alone's with its seed until a
        trial's worth of its own is measured: a start-up step taken while the drafter started
        too can be far slower than the target alone runs)."""
        tally = self._tallies[mode]
        if mode != ALONE or self._alone_seed_s is None or tally.tokens >= self.config.trial_tokens:
            return tally.rate  # a trial's own measurement replaces the seed
        seed = self.config.seed_tokens
        return (tally.tokens + seed) / (tally.seconds + seed * self._alone_seed_s)

    def observe(self, mode: str, num_tokens: int, seconds: float) -> None:
        """`num_tokens` were committed in `seconds` while `mode` ran; decides again at the end
        of the present mode's trial."""
        if not self.config.enabled or num_tokens <= 0 or seconds <= 0:
            return
        decay = self.config.decay
        tally = self._tallies[mode]
        tally.tokens = tally.tokens * decay + num_tokens
        tally.seconds = tally.seconds * decay + seconds
        self._committed += num_tokens
        if mode != self.mode:
            return
        self._since += num_tokens
        if self._since >= self.config.trial_tokens:
            self._decide()

    def _decide(self) -> None:
        """At the end of a trial: the mode it measured won or lost; then a mode whose
        measurement is due, else the best."""
        tried = self.mode
        rates = {m: r for m in MODES if (r := self.rate(m)) is not None}
        best = max(rates, key=lambda m: (self._score(m, rates[m]), MODES.index(m)))
        if tried == best:
            self._wait[tried] = float(self.config.retry_tokens)
            self._due_at[tried] = math.inf  # measured as it runs
        elif tried in rates:
            self._lost(tried, rates[best] / rates[tried])
        for mode in MODES:  # a former best that the last trial beat
            if mode != best and self._due_at[mode] == math.inf:
                self._lost(mode, rates[best] / rates[mode])
        due = [m for m in MODES if m != tried and self._committed >= self._due_at[m]]
        if due:
            self._choose(due[0], f"measuring {due[0]}")
            return
        self._choose(best, self._why(best, rates))

    def _score(self, mode: str, rate: float) -> float:
        """`rate` less the margin a mode must win by for each step of speculation it adds."""
        steps = len(MODES) - 1 - MODES.index(mode)
        return rate / (1.0 + self.config.margin) ** steps

    def _lost(self, mode: str, by: float) -> None:
        """`mode` measured `by` times slower than the best: measured again after its wait,
        longer the more it lost by, and twice as long the next time."""
        longest = float(self.config.max_retry_tokens)
        self._due_at[mode] = self._committed + min(self._wait[mode] * max(1.0, by), longest)
        self._wait[mode] = min(2 * self._wait[mode], longest)

    def _why(self, best: str, rates: dict[str, float]) -> str:
        shown = ", ".join(f"{m} {r:.2f}" for m, r in rates.items())
        return f"{best}: best measured tokens/s ({shown})"

    def _choose(self, mode: str, reason: str) -> None:
        self.mode = mode
        self.reason = reason
        self._since = 0.0
