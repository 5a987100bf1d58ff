"""Per-request draft length from the acceptance and latencies seen so far (the goodput trade-off).

Pure arithmetic, no I/O: the router feeds it each verify pass's outcome and the measured
draft and verify times, and asks it for the next round's plan.

Contract: `DraftLength.next_plan()` is the plan the goodput model (`cluster.routing.goodput`,
`best_plan`) prices best among k in 0..max_k, pipelined or serial, and, for a pipelined round,
pre-drafting up to the request's `max_fan_out` branches, at this request's estimates:
acceptance `a` from a Beta estimate decaying towards its prior, and the measured draft and
verify times (kept apart for a side alone and for both at once), scaled by the replicas'
reported step cost curves under the symmetric-batch assumption (every session of a step sends
blocks like this one). After a run of k = 0 rounds the estimate drifts back to the prior and
speculation is tried again. With no load reported, the measured constants price every plan.

The model, term by term, and why each choice: docs/architecture.md, "Adaptive plan: the model".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.goodput import Plan, VerifyCost, best_plan, verify_seconds
from cluster.routing.predraft_budget import PredraftCost, branch_steps
from cluster.runtime.draft_block import StepLoad

HIT_PRIOR = 1.0
"""Pseudo-rounds, at the odds, behind a request's measured hit rate of pre-drafted rounds."""


@dataclass
class Latencies:
    """Smoothed seconds per drafted token and per verify pass, under one condition (alone, or
    while the other side works too)."""

    draft_s: float | None = None
    verify_s: float | None = None
    draft_ratio: float | None = None
    """Measured seconds per drafted token over the predicted seconds of the drafter's step
    that served it (from calls that reported a load)."""
    verify_ratio: float | None = None
    """Measured seconds of a verify pass over the predicted seconds of its step."""

    @property
    def known(self) -> bool:
        return self.draft_s is not None and self.verify_s is not None


@dataclass
class Load:
    """One side's latest step cost curve and its smoothed batch."""

    sequences: float
    tokens: float
    base_s: float
    per_token_s: float

    def step_s(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * tokens


def usable_load(load: StepLoad | None) -> Load | None:
    """`load` as a curve to price with, or None when it cannot be: not reported, or a fit
    that predicts no time for the step it served. A slightly negative fitted term (noise)
    counts as 0."""
    if load is None or load.batch_sequences < 1 or load.batch_tokens < 1:
        return None
    base_s, per_token_s = max(load.cost_base_s, 0.0), max(load.cost_per_token_s, 0.0)
    curve = Load(float(load.batch_sequences), float(load.batch_tokens), base_s, per_token_s)
    step_s = curve.step_s(curve.tokens)
    return curve if math.isfinite(step_s) and step_s > 0 else None


class DraftLength:
    """One request's acceptance and latency estimates, and the length they recommend."""

    def __init__(
        self, config: DraftLengthConfig, max_k: int, pipelined: bool, max_fan_out: int = 0
    ) -> None:
        self.config = config
        self.max_k = max_k
        self.pipelined = pipelined
        """Whether the request allows pipelined rounds (the plan decides each round)."""
        self.max_fan_out = max_fan_out
        """The widest fan-out a pipelined round may pre-draft (0: none; the plan decides each
        round's, up to it)."""
        self._predraft_extra_s: dict[int, float] = {}
        """By fan-out, measured seconds of a pre-draft beyond its predicted steps: the
        hand-offs of the call and its branches' engine work per row, which the device's curve
        leaves out. Added, not scaled, so that it does not grow with the block's length; a
        fan-out not yet measured takes the nearest measured one's."""
        self._hits = 0.0
        self._hit_odds = 0.0
        """Pre-drafted rounds that hit and the odds they were chosen with, decayed alike."""
        self._accepted = 0.0
        self._rejected = 0.0
        self._alone = Latencies()
        """Measured while the other side was idle: serial rounds, and redrafts after a miss."""
        self._beside = Latencies()
        """Measured while a draft ahead and a verify pass ran at once (pipelined rounds)."""
        self._verifier_load: Load | None = None
        self._drafter_load: Load | None = None

    @property
    def acceptance(self) -> float:
        accepted = self._accepted + self.config.prior_accepted
        return accepted / (accepted + self._rejected + self.config.prior_rejected)

    def inherit(self, recent: DraftLength) -> None:
        """Start from another request's measured latencies and loads (not its acceptance, which
        is the text's own): a new request then prices its first rounds with the replicas'
        present load instead of running its full length until it has timed a round itself. A
        short request would otherwise end before it adapted, and under load every new request
        would speculate at full length."""
        self._alone = dataclasses.replace(recent._alone)
        self._beside = dataclasses.replace(recent._beside)
        self._verifier_load = (
            None if recent._verifier_load is None else dataclasses.replace(recent._verifier_load)
        )
        self._drafter_load = (
            None if recent._drafter_load is None else dataclasses.replace(recent._drafter_load)
        )
        self._predraft_extra_s = dict(recent._predraft_extra_s)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Count one verify pass's outcome (nothing drafted: only the decay)."""
        self._accepted = self._accepted * self.config.decay + num_accepted
        self._rejected = self._rejected * self.config.decay + (num_accepted < num_drafted)

    def observe_draft(
        self,
        num_tokens: int,
        seconds: float,
        overlapped: bool = False,
        load: StepLoad | None = None,
    ) -> None:
        """A draft of `num_tokens` took `seconds`; `overlapped`: a verify pass ran meanwhile;
        `load`: the drafter's, as its block reported it."""
        if num_tokens <= 0:
            return
        latencies = self._beside if overlapped else self._alone
        per_token_s = seconds / num_tokens
        latencies.draft_s = self._smooth(latencies.draft_s, per_token_s)
        self._drafter_load = self._observe_load(self._drafter_load, load)
        if self._drafter_load is not None:
            assert load is not None
            ratio = per_token_s / self._drafter_load.step_s(load.batch_tokens)
            latencies.draft_ratio = self._smooth(latencies.draft_ratio, ratio)

    def observe_verify(
        self, seconds: float, overlapped: bool = False, load: StepLoad | None = None
    ) -> None:
        """A verify pass took `seconds`; `overlapped`: a draft ahead ran meanwhile; `load`:
        the verifier's, as its verdict reported it."""
        latencies = self._beside if overlapped else self._alone
        latencies.verify_s = self._smooth(latencies.verify_s, seconds)
        self._verifier_load = self._observe_load(self._verifier_load, load)
        if self._verifier_load is not None:
            assert load is not None
            ratio = seconds / self._verifier_load.step_s(load.batch_tokens)
            latencies.verify_ratio = self._smooth(latencies.verify_ratio, ratio)

    def observe_predraft(
        self, seconds: float, fan_out: int, num_tokens: int, load: StepLoad | None = None
    ) -> None:
        """A pre-draft of `fan_out` branches of `num_tokens` took `seconds` (it ran beside a
        verify pass); `load`: the drafter's as its branches reported it. While every round
        hits, no plain draft reports the drafter's load, so this one keeps it current: its
        batch is taken per session (the step held `fan_out` rows of this one, and of each
        other pre-drafting alike)."""
        if fan_out <= 0 or num_tokens <= 0:
            return
        if load is not None:
            per_session = dataclasses.replace(
                load,
                batch_sequences=max(1, round(load.batch_sequences / fan_out)),
                batch_tokens=max(1, round(load.batch_tokens / fan_out)),
            )
            self._drafter_load = self._observe_load(self._drafter_load, per_session)
        if self._predraft_step_s(fan_out) is None:
            return
        predicted = self._predraft_step_s(fan_out)
        assert predicted is not None
        extra_s = seconds - branch_steps(num_tokens) * predicted
        self._predraft_extra_s[fan_out] = self._smooth(self._predraft_extra_s.get(fan_out), extra_s)

    def observe_predraft_outcome(self, hit: bool, odds: float) -> None:
        """A pre-drafted round hit a branch or not; its branches were chosen with `odds` of a
        hit."""
        self._hits = self._hits * self.config.decay + hit
        self._hit_odds = self._hit_odds * self.config.decay + odds

    @property
    def hit_scale(self) -> float:
        """How often this request's branches hit, over the odds they were chosen with; one
        pseudo-round at odds holds it at 1 until rounds show otherwise."""
        return (self._hits + HIT_PRIOR) / (self._hit_odds + HIT_PRIOR)

    def _predraft_step_s(self, fan_out: int) -> float | None:
        """Predicted seconds of one drafter step of `fan_out` branches beside a verify pass,
        before this request's measured correction: the measured draft latency (beside a
        verify pass where known), at `fan_out` times the rows on the drafter's step cost
        curve (every drafting session pre-drafting alike), or `fan_out` times as long
        without one. None before a draft is timed."""
        latencies = self._beside if self._beside.draft_s is not None else self._alone
        if latencies.draft_s is None:
            return None
        drafter, ratio = self._drafter_load, latencies.draft_ratio
        if drafter is not None and ratio is not None:
            return ratio * drafter.step_s(drafter.tokens * fan_out)
        return latencies.draft_s * fan_out

    def _predraft_cost(self) -> PredraftCost | None:
        if self.max_fan_out <= 0 or self._predraft_step_s(1) is None:
            return None
        # Each fan-out's step and extra once: the plan prices every block length at each.
        measured = self._predraft_extra_s
        steps: dict[int, float] = {}
        extras: dict[int, float] = {}
        for fan_out in range(1, self.max_fan_out + 1):
            step = self._predraft_step_s(fan_out)
            assert step is not None
            nearest = min(measured, key=lambda f: (abs(f - fan_out), f), default=None)
            steps[fan_out] = step
            extras[fan_out] = 0.0 if nearest is None else measured[nearest]
        return PredraftCost(self.max_fan_out, steps.__getitem__, self.hit_scale, extras.__getitem__)

    def _observe_load(self, old: Load | None, reported: StepLoad | None) -> Load | None:
        """The side's load after a call reported `reported`: its latest curve and smoothed
        batch; None (priced as without load) once a call reports none it can price with."""
        new = usable_load(reported)
        if new is None or old is None:
            return new
        new.sequences = self._smooth(old.sequences, new.sequences)
        new.tokens = self._smooth(old.tokens, new.tokens)
        return new

    def _smooth(self, old: float | None, new: float) -> float:
        weight = self.config.latency_decay
        return new if old is None else weight * old + (1 - weight) * new

    def next_plan(self) -> Plan:
        """The next round's plan. The request's own (`max_k`, pipelined as asked, no
        pre-drafting) until a round alone has been timed; a pipelined request then runs one
        serial round to time the two sides alone, so that serial and pipelined plans are each
        priced with their own measured latencies. A request that did not ask for pipelining
        never gets it, nor pre-drafting."""
        pipelined = self.pipelined and self.max_k > 0
        asked = Plan(self.max_k, pipelined, self.max_fan_out if pipelined else 0)
        alone, beside = self._alone, self._beside
        if not self.config.enabled:
            return asked
        if not alone.known:
            if beside.verify_s is not None:  # pipelined rounds so far: time one alone
                return Plan(self.max_k, False)
            # Pre-drafting waits for a price: on a drafter that shares the verifier's cores,
            # F branches beside a verify pass can cost more than they save.
            return dataclasses.replace(asked, fan_out=0)
        draft_s, verify_s = self._priced(alone)
        overlapped = self._priced(beside) if beside.known else None
        return best_plan(
            self.acceptance, self.max_k, draft_s, verify_s, self.pipelined, overlapped,
            self._predraft_cost(),
        )  # fmt: skip

    def lookup_plan(self) -> Plan:
        """The plan of a round whose block costs no model (prompt lookup, the suffix drafter):
        the block length that pays with free drafting at the request's acceptance, priced by
        the verify passes timed so far; the request's own length before any is."""
        verify_s = self._verify_cost()
        if verify_s is None:
            return Plan(self.max_k, False)
        return best_plan(self.acceptance, self.max_k, 0.0, verify_s, may_pipeline=False)

    def paying_length(self, acceptance: float, longest: int) -> int:
        """The longest-paying length, up to `longest`, of a block that costs no model to draft
        and whose tokens are accepted at `acceptance` (the suffix drafter's): the k with the
        most tokens per second of verify passes, as timed so far (`longest` before any is). On
        a flat verify cost (a GPU's) that is `longest`; where a pass of k + 1 tokens costs
        about k + 1 steps (bf16 on a CPU without native bf16), a long block pays only if
        nearly always accepted."""
        verify_s = self._verify_cost()
        if verify_s is None or longest <= 1:
            return max(1, longest)
        best_k, best_rate, tokens = 1, 0.0, 1.0
        for k in range(1, longest + 1):
            tokens += acceptance**k
            seconds = verify_seconds(verify_s, k)
            value = tokens / seconds if seconds > 0 else math.inf
            if value > best_rate:
                best_k, best_rate = k, value
        return best_k

    def _verify_cost(self) -> VerifyCost | None:
        """Seconds of a verify pass as timed so far (a function of the block's length under a
        known verifier load); None before any is timed, or without the adaptive plan."""
        latencies = self._alone if self._alone.verify_s is not None else self._beside
        if not self.config.enabled or latencies.verify_s is None:
            return None
        return self._verify_priced(latencies)

    def _verify_priced(self, latencies: Latencies) -> VerifyCost:
        """Seconds of a verify pass under one condition (`latencies.verify_s` known): a
        function of the block's length under a known verifier load, else the measured time."""
        assert latencies.verify_s is not None
        verifier, ratio = self._verifier_load, latencies.verify_ratio
        if verifier is None or ratio is None:
            return latencies.verify_s
        sequences, step_s = verifier.sequences, verifier.step_s
        return lambda k: ratio * step_s(sequences * (k + 1))

    def _priced(self, latencies: Latencies) -> tuple[float, VerifyCost]:
        """Seconds per drafted token and of a verify pass (a function of the block's length
        under a known verifier load) under one condition; see the module's docstring."""
        assert latencies.draft_s is not None and latencies.verify_s is not None
        draft_s: float = latencies.draft_s
        drafter, ratio = self._drafter_load, latencies.draft_ratio
        if drafter is not None and ratio is not None:
            draft_s = ratio * drafter.step_s(drafter.tokens)
        return draft_s, self._verify_priced(latencies)
