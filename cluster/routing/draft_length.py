"""Per-request draft length from the acceptance and latencies seen so far (the goodput trade-off).

Pure arithmetic, no I/O: the router feeds it each verify pass's outcome and the measured
draft and verify times, and asks it for the next round's plan.

Model (Leviathan et al.): each drafted token is accepted with probability `a`, independently.
A block of `k` tokens then commits E(k) = (1 - a^(k+1)) / (1 - a) tokens per verify pass. Its
cost is k draft steps of `d` seconds and one verify pass of `v` seconds. Serial: T(k) = k d + v.
Pipelined, the next block is drafted while this one is verified, so every round waits for the
longer of the two, max(v, k d), and that draft survives only if all k are accepted
(probability a^k); otherwise the next round first drafts afresh: T(k) = max(v, k d) +
(1 - a^k) k d. A surviving draft takes the place of the bonus token (deferred), so a pipelined
round commits E(k) - a^k tokens. The plan
chosen is the k in 0..max_k, pipelined or not, with the most tokens per second E(k) / T(k):
k = 0 (the target alone: one token per pass of `v`) wins when acceptance is low or drafting is
slow, for example when a busy drafter's steps queue behind other requests'; a serial round wins
over a pipelined one when a block takes longer to draft than to verify and is often rejected
(the draft ahead is then mostly wasted wait). So the same rule turns speculation and pipelining
down under load and back up when they pay.

Where the two sides share a machine, a draft and a verify pass that run at once each take
longer than alone, so the latencies are measured apart: alone (serial rounds, a redraft after a
miss) and beside each other (a pipelined round's verify pass and draft ahead). Each plan is
priced with the ones it would run under.

Estimating `a`: a block of k with n accepted is n successes and, if n < k, one failure. Counts
decay by `decay` per pass, towards a Beta prior (`prior_accepted`, `prior_rejected`), so the
estimate follows a request whose text changes character, and after a run of k = 0 passes (which
observe nothing) the estimate drifts back to the prior and speculation is tried again.
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class DraftLengthConfig:
    """How the router picks each block's length (up to the request's draft_tokens)."""

    enabled: bool = False
    """False: every block has the request's draft_tokens."""
    prior_accepted: float = 3.0
    prior_rejected: float = 1.0
    """A Beta(3, 1) prior: an acceptance of 0.75 until the request shows otherwise."""
    decay: float = 0.9
    """Weight kept by past outcomes per verify pass: about the last 10 passes count."""
    latency_decay: float = 0.8
    """Weight kept by past draft and verify latencies per measurement."""

    def __post_init__(self) -> None:
        if self.prior_accepted <= 0 or self.prior_rejected <= 0:
            raise InvalidArgumentError("prior_accepted and prior_rejected must be > 0")
        for name in ("decay", "latency_decay"):
            if not 0 <= getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def expected_tokens(acceptance: float, k: int, pipelined: bool = False) -> float:
    """Tokens one verify pass of a k-token block commits: 1 + a + ... + a^k, less the bonus
    token that a pipelined round defers when all k are accepted."""
    tokens = float(sum(acceptance**i for i in range(k + 1)))
    return tokens - acceptance**k if pipelined and k > 0 else tokens


def pass_seconds(
    acceptance: float,
    k: int,
    draft_s: float,
    verify_s: float,
    pipelined: bool,
    overlapped: tuple[float, float] | None = None,
) -> float:
    """Expected wall time of one round with a k-token block. `overlapped` is (draft_s,
    verify_s) while a draft and a verify pass run at once, when sharing the machine makes them
    slower than alone; by default the same as alone. A missed draft ahead is redrafted alone."""
    if not pipelined or k == 0:
        return k * draft_s + verify_s
    draft_beside, verify_beside = overlapped or (draft_s, verify_s)
    return max(verify_beside, k * draft_beside) + (1 - acceptance**k) * k * draft_s


@dataclass(frozen=True)
class Plan:
    """How the next round runs: its block length, and whether the block after it is drafted
    while this one is verified."""

    k: int
    pipelined: bool


def rate(
    acceptance: float,
    plan: Plan,
    draft_s: float,
    verify_s: float,
    overlapped: tuple[float, float] | None = None,
) -> float:
    """Expected tokens per second of rounds run to `plan`."""
    tokens = expected_tokens(acceptance, plan.k, plan.pipelined)
    seconds = pass_seconds(acceptance, plan.k, draft_s, verify_s, plan.pipelined, overlapped)
    return tokens / seconds


def best_plan(
    acceptance: float,
    max_k: int,
    draft_s: float,
    verify_s: float,
    may_pipeline: bool,
    overlapped: tuple[float, float] | None = None,
) -> Plan:
    """The plan with the most tokens per second; on ties serial, then the shortest block."""
    plans = [Plan(k, False) for k in range(max_k + 1)]
    if may_pipeline:
        plans += [Plan(k, True) for k in range(1, max_k + 1)]
    return max(
        plans,
        key=lambda p: (rate(acceptance, p, draft_s, verify_s, overlapped), not p.pipelined, -p.k),
    )


@dataclass
class Latencies:
    """Smoothed seconds per drafted token and per verify pass, under one condition (alone, or
    while the other side works too)."""

    draft_s: float | None = None
    verify_s: float | None = None

    @property
    def known(self) -> bool:
        return self.draft_s is not None and self.verify_s is not None


class DraftLength:
    """One request's acceptance and latency estimates, and the length they recommend."""

    def __init__(self, config: DraftLengthConfig, max_k: int, pipelined: bool) -> None:
        self.config = config
        self.max_k = max_k
        self.pipelined = pipelined
        """Whether the request allows pipelined rounds (the plan decides each round)."""
        self._accepted = 0.0
        self._rejected = 0.0
        self._alone = Latencies()
        """Measured while the other side was idle: serial rounds, and redrafts after a miss."""
        self._beside = Latencies()
        """Measured while a draft ahead and a verify pass ran at once (pipelined rounds)."""

    @property
    def acceptance(self) -> float:
        accepted = self._accepted + self.config.prior_accepted
        return accepted / (accepted + self._rejected + self.config.prior_rejected)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Count one verify pass's outcome (nothing drafted: only the decay)."""
        self._accepted = self._accepted * self.config.decay + num_accepted
        self._rejected = self._rejected * self.config.decay + (num_accepted < num_drafted)

    def observe_draft(self, num_tokens: int, seconds: float, overlapped: bool = False) -> None:
        """A draft of `num_tokens` took `seconds`; `overlapped`: a verify pass ran meanwhile."""
        if num_tokens > 0:
            latencies = self._beside if overlapped else self._alone
            latencies.draft_s = self._smooth(latencies.draft_s, seconds / num_tokens)

    def observe_verify(self, seconds: float, overlapped: bool = False) -> None:
        """A verify pass took `seconds`; `overlapped`: a draft ahead ran meanwhile."""
        latencies = self._beside if overlapped else self._alone
        latencies.verify_s = self._smooth(latencies.verify_s, seconds)

    def _smooth(self, old: float | None, new: float) -> float:
        weight = self.config.latency_decay
        return new if old is None else weight * old + (1 - weight) * new

    def next_plan(self) -> Plan:
        """The next round's plan. The request's own (`max_k`, pipelined as asked) until a
        round alone has been timed; a pipelined request then runs one serial round to time
        the two sides alone, so that serial and pipelined plans are each priced with their own
        measured latencies. A request that did not ask for pipelining never gets it."""
        asked = Plan(self.max_k, self.pipelined and self.max_k > 0)
        alone, beside = self._alone, self._beside
        if not self.config.enabled:
            return asked
        if not alone.known:
            if beside.known:  # pipelined rounds so far: time one alone
                return Plan(self.max_k, False)
            return asked
        assert alone.draft_s is not None and alone.verify_s is not None
        overlapped = None
        if beside.draft_s is not None and beside.verify_s is not None:
            overlapped = (beside.draft_s, beside.verify_s)
        return best_plan(
            self.acceptance,
            self.max_k,
            alone.draft_s,
            alone.verify_s,
            self.pipelined,
            overlapped,
        )
