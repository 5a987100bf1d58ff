"""How a soak request ended, whose fault an error was, and the tally of them all.

Pure apart from a lock: `judge` decides from the plan (`RequestSpec`) and what the client saw
(`RequestOutcome`) alone.

An error is the request's own when its plan asked for it: DEADLINE_EXCEEDED for a request that
set a short deadline, INVALID_ARGUMENT for one sent with bad input (which must be refused: a bad
request served is a failure too). A client that closes its stream as planned sees no error.
Every other error is the service's: the request failed, or was lost (not done after
`LOST_AFTER_S`, which ends as DEADLINE_EXCEEDED on a request that set no deadline of its own).
A RESOURCE_EXHAUSTED with a retry hint before any token is a refusal, which the client retries
after the hint (`cluster.tools.soak.clients`); refused until the load ended, it failed.

A greedy request's tokens, whole or as far as they came, must be the target alone's
(`reference`: the same prompt decoded greedily with draft length 0): the first `max_tokens` of
the reference, or a prefix of them for a request that ended early.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.tools.soak.plan import Ending, RequestSpec

MAX_EXAMPLES = 5
"""Failure messages kept per status, for the report."""


@dataclass(frozen=True)
class RequestOutcome:
    """What the client saw of one request (its last attempt, after any refusals)."""

    tokens: tuple[int, ...]
    finished: bool
    """The stream ended with a finish reason."""
    error: str | None = None
    """The gRPC status name it failed with; None if it finished or the client left it."""
    message: str = ""
    refusals: int = 0
    """RESOURCE_EXHAUSTED answers with a retry hint before it ran (each retried)."""
    closed_early: bool = False
    """The client closed the stream as planned (DISCONNECT)."""
    retry_hint: bool = False
    """Its error said when to retry (a RESOURCE_EXHAUSTED refusal the client stopped retrying
    when the load ended)."""


class Judgement(enum.Enum):
    OK = "ok"
    """Finished, or left by its client as planned."""
    OWN_ERROR = "own_error"
    """Ended by an error its plan asked for."""
    FAILED = "failed"
    """Ended by the service's error (or a bad request served)."""


OWN_ERRORS = {Ending.DEADLINE: "DEADLINE_EXCEEDED", Ending.BAD_INPUT: "INVALID_ARGUMENT"}


def judge(spec: RequestSpec, outcome: RequestOutcome) -> Judgement:
    """Whose fault the way `spec` ended was (see the module's docstring)."""
    own = OWN_ERRORS.get(spec.ending)
    if spec.ending is Ending.BAD_INPUT:
        return Judgement.OWN_ERROR if outcome.error == own else Judgement.FAILED
    if outcome.error is None:
        return Judgement.OK
    return Judgement.OWN_ERROR if outcome.error == own else Judgement.FAILED


def failure_kind(outcome: RequestOutcome) -> str:
    """The status of a failed request; a RESOURCE_EXHAUSTED says which: mid-request (after
    tokens came), refused with no retry hint the client could read, or refused (with one)
    until the client stopped retrying."""
    if outcome.error is None:
        return "SERVED_BAD_INPUT"
    if outcome.error != "RESOURCE_EXHAUSTED":
        return outcome.error
    if outcome.tokens:
        return "RESOURCE_EXHAUSTED mid-request"
    if outcome.retry_hint:
        return "RESOURCE_EXHAUSTED refused to the end"
    return "RESOURCE_EXHAUSTED refused with no retry hint"


def differs(spec: RequestSpec, outcome: RequestOutcome, reference: Sequence[int] | None) -> bool:
    """Whether a greedy request's tokens differ from the target alone's (False for a sampled
    request, or with no reference)."""
    if not spec.greedy or reference is None:
        return False
    expected = tuple(reference[: spec.max_tokens])
    if outcome.finished:
        return outcome.tokens != expected
    return outcome.tokens != expected[: len(outcome.tokens)]


@dataclass
class Tally:
    """Every request's end, counted; `add` is safe from any thread."""

    requests: int = 0
    tokens: int = 0
    by_ending: Counter[str] = field(default_factory=Counter)
    """`<ending> <verdict>` -> requests."""
    failed: Counter[str] = field(default_factory=Counter)
    """Status name -> requests failed by the service's error."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    own_errors: Counter[str] = field(default_factory=Counter)
    refusals: int = 0
    """Retried RESOURCE_EXHAUSTED answers (a request refused twice counts twice)."""
    greedy_compared: int = 0
    mismatches: int = 0
    mismatch_examples: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(
        self, spec: RequestSpec, outcome: RequestOutcome, reference: Sequence[int] | None
    ) -> Judgement:
        judged = judge(spec, outcome)
        wrong = differs(spec, outcome, reference)
        with self.lock:
            self.requests += 1
            self.tokens += len(outcome.tokens)
            self.refusals += outcome.refusals
            self.by_ending[f"{spec.ending.value} {judged.value}"] += 1
            if judged is Judgement.FAILED:
                status = failure_kind(outcome)
                self.failed[status] += 1
                kept = self.examples.setdefault(status, [])
                if len(kept) < MAX_EXAMPLES:
                    kept.append(outcome.message[:300])
            elif judged is Judgement.OWN_ERROR:
                self.own_errors[outcome.error or ""] += 1
            if spec.greedy and reference is not None:
                self.greedy_compared += 1
                self.mismatches += wrong
                if wrong and len(self.mismatch_examples) < MAX_EXAMPLES:
                    self.mismatch_examples.append(
                        {"stream": spec.stream, "index": spec.index, "prompt": spec.prompt,
                         "max_tokens": spec.max_tokens, "received": len(outcome.tokens)}
                    )  # fmt: skip
        return judged

    @property
    def num_failed(self) -> int:
        return sum(self.failed.values())

    def to_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "tokens": self.tokens,
                "by_ending": dict(sorted(self.by_ending.items())),
                "failed": dict(self.failed),
                "failure_examples": {k: list(v) for k, v in self.examples.items()},
                "own_errors": dict(self.own_errors),
                "refusals_retried": self.refusals,
                "greedy_compared": self.greedy_compared,
                "greedy_mismatches": self.mismatches,
                "mismatch_examples": list(self.mismatch_examples),
            }
