"""The audit's verdicts: served tokens against the plain target's replay, position by position.

Contract: pure Python over token ids and a `Replay` (what `verifier.reference.replay`, the
plain target's replay, returns); no model, no I/O. It lives in the shared runtime because the
CLI, the service's audit API and the verifier replica all speak these types.
`compare` turns one request's served tokens and its replay into an `AuditReport`; `cause`
names what a report shows; `summarize`, `render_table` and `report_json` present many.

Words
    matched      positions where the replay chose the served token (teacher forcing: each
                 position is checked on the served prefix, so one mismatch does not hide the
                 positions after it).
    gap          at a position, the chosen token's score minus the best other token's, under
                 the request's rule: raw logits for greedy, log(p/E) for seed-exact (see
                 `verifier.reference`). Small: a near-tie.
    served gap   the chosen token's score minus the served token's: how far the service's own
                 numbers would have to be from the replay's for it to pick what it served.
                 +inf: the served token could not be picked at all (p = 0 under the rule).
    near-tie     a mismatch whose served gap is below `NEAR_TIE_GAP`: rounding (bf16 against
                 fp32, or one batch shape against another) can explain it.
    divergence   a mismatch no rounding explains: a bug, a wrong model, or a wrong setting.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from cluster.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class Replay:
    """What the plain target chose at each served position, and how close each call was.

    Scores: raw logits for a greedy request; log(p(x) / E(seed, t, x)) for a seed-exact one
    (p: the distribution sampled, after temperature, top-k and top-p; E: the exponential noise
    of `cluster.runtime.gumbel`; -inf where p is 0)."""

    tokens: tuple[int, ...]
    """The target's own choice at each served position, given the served prefix."""
    gaps: tuple[float, ...]
    """At each position: the chosen token's score minus the best other token's (>= 0 but for
    rounding; +inf when no other token can be chosen)."""
    dtype: str
    """The dtype the replay ran in, e.g. "float32", "bfloat16"."""
    served_gaps: tuple[float, ...] = ()
    """At each position: the chosen token's score minus the served token's (0 where they are
    the same token; +inf where the served token could not be chosen at all). How far the
    service's numbers would have had to be off to explain a mismatch; empty if not computed."""


RULES = ("greedy", "seed_exact")
"""The rules a request can be audited under token by token."""

CAUSES = ("match", "near_tie", "divergence")

NEAR_TIE_GAP = 0.5
"""A mismatch whose served gap is below this is a near-tie, at or above it a divergence.

Why 0.5 (logits): a bf16 number has 8 significant bits, so a logit in [16, 32), where a
confident model's best logits sit, is rounded to a multiple of 0.125, and the hidden states
carry rounding of their own through every layer. Measured with the qwen-coder target (1.5B)
over 400 positions of Python source, bf16 against fp32 on the same tokens: the top-2 gap moved
by 0.038 at the median, 0.166 at the 99th percentile and 0.229 at most, and the argmax flipped
at 7 positions whose fp32 gaps were 0.013 to 0.111 (docs/models.md records one at 0.019).
Twice the largest change seen leaves room for longer contexts and larger models. A drafted
token accepted without the target's consent is usually logits away from the target's choice.
In fp32 on both sides no mismatch is expected at all: batch shapes move fp32 logits by about
1e-6. For seed-exact requests the gap is in log(p/E), which moves as logits / temperature: at
a temperature below 1 the same threshold is stricter than in logits."""


@dataclass(frozen=True)
class AuditReport:
    """One request's audit: how many served tokens the plain target would have chosen too,
    and the evidence at the first position where it would not."""

    matched: int
    total: int
    first_divergence: int | None
    """Index into the served tokens of the first mismatch; None when all matched."""
    gap: float | None
    """The replay's top-2 gap (`Replay.gaps`) at `first_divergence`."""
    served_token: int | None
    reference_token: int | None
    rule: str
    """"greedy" or "seed_exact"."""
    drafter: str
    """Which drafter served it (free text: "model", "prompt_lookup", "none", a replica...)."""
    dtype: str
    """The dtype the replay ran in."""
    served_gap: float | None = None
    """The served gap at `first_divergence` (>= `gap`; +inf: the served token was impossible)."""
    worst_gap: float | None = None
    """The largest served gap over every mismatch: what `cause` judges by."""

    @property
    def ok(self) -> bool:
        """True when every served token is the target's own choice."""
        return self.matched == self.total

    @property
    def mismatched(self) -> int:
        return self.total - self.matched


def cause(report: AuditReport) -> str:
    """ "match" when every token matched; "near_tie" when every mismatch is within
    `NEAR_TIE_GAP` (rounding explains it); else "divergence"."""
    if report.ok:
        return "match"
    judged = report.worst_gap if report.worst_gap is not None else report.gap
    return "near_tie" if judged is not None and judged < NEAR_TIE_GAP else "divergence"


def compare(served_tokens: Sequence[int], replay: Replay, rule: str, drafter: str) -> AuditReport:
    """The report for `served_tokens` against their replay (the same length)."""
    if rule not in RULES:
        raise InvalidArgumentError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    served = [int(t) for t in served_tokens]
    if len(served) != len(replay.tokens) or len(replay.gaps) != len(replay.tokens):
        raise InvalidArgumentError(
            f"the replay covers {len(replay.tokens)} tokens ({len(replay.gaps)} gaps), "
            f"the service served {len(served)}"
        )
    # Without served gaps (a replay that did not compute them) the top-2 gap is the best
    # evidence there is: it is what the served gap is when the served token was second best.
    served_gaps = replay.served_gaps or replay.gaps
    misses = [i for i, (s, r) in enumerate(zip(served, replay.tokens, strict=True)) if s != r]
    if not misses:
        return AuditReport(
            matched=len(served),
            total=len(served),
            first_divergence=None,
            gap=None,
            served_token=None,
            reference_token=None,
            rule=rule,
            drafter=drafter,
            dtype=replay.dtype,
        )
    first = misses[0]
    return AuditReport(
        matched=len(served) - len(misses),
        total=len(served),
        first_divergence=first,
        gap=replay.gaps[first],
        served_token=served[first],
        reference_token=replay.tokens[first],
        rule=rule,
        drafter=drafter,
        dtype=replay.dtype,
        served_gap=served_gaps[first],
        worst_gap=max(served_gaps[i] for i in misses),
    )


@dataclass(frozen=True)
class AuditSummary:
    """Many reports added up."""

    requests: int
    matched_tokens: int
    total_tokens: int
    by_cause: Mapping[str, int]
    """Requests per cause, every cause of `CAUSES` present."""

    @property
    def ok(self) -> bool:
        return self.by_cause["match"] == self.requests

    @property
    def matched_share(self) -> float:
        """Matched over total tokens; 1.0 when nothing was served."""
        return self.matched_tokens / self.total_tokens if self.total_tokens else 1.0


def summarize(reports: Sequence[AuditReport]) -> AuditSummary:
    counts = Counter(cause(report) for report in reports)
    return AuditSummary(
        requests=len(reports),
        matched_tokens=sum(r.matched for r in reports),
        total_tokens=sum(r.total for r in reports),
        by_cause={name: counts.get(name, 0) for name in CAUSES},
    )


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4f}"


def render_table(reports: Sequence[AuditReport], labels: Sequence[str] | None = None) -> str:
    """A plain-text table, one row per report (labelled by `labels`, else by number), and a
    summary line."""
    names = list(labels) if labels is not None else [str(i) for i in range(len(reports))]
    if len(names) != len(reports):
        raise InvalidArgumentError(f"{len(reports)} reports but {len(names)} labels")
    header = (
        "request", "rule", "drafter", "dtype", "matched", "first", "served", "reference",
        "gap", "served gap", "worst gap", "cause",
    )  # fmt: skip
    rows = [header]
    for name, r in zip(names, reports, strict=True):
        rows.append(
            (
                name, r.rule, r.drafter, r.dtype, f"{r.matched}/{r.total}",
                "-" if r.first_divergence is None else str(r.first_divergence),
                "-" if r.served_token is None else str(r.served_token),
                "-" if r.reference_token is None else str(r.reference_token),
                _number(r.gap), _number(r.served_gap), _number(r.worst_gap), cause(r),
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    summary = summarize(reports)
    causes = ", ".join(f"{summary.by_cause[name]} {name}" for name in CAUSES)
    lines.append(
        f"{summary.matched_tokens}/{summary.total_tokens} tokens matched "
        f"({100 * summary.matched_share:.2f}%) over {summary.requests} requests: {causes}"
    )
    return "\n".join(lines)


def _json_number(value: float | None) -> float | str | None:
    """JSON has no infinity: +inf is written as the string "inf"."""
    return "inf" if value is not None and math.isinf(value) else value


def report_json(report: AuditReport) -> dict[str, object]:
    """Every field of `report`, plus "ok" and "cause"; an infinite gap is the string "inf"."""
    values: dict[str, object] = {}
    for field in fields(report):
        value = getattr(report, field.name)
        values[field.name] = _json_number(value) if isinstance(value, float) else value
    values["ok"] = report.ok
    values["cause"] = cause(report)
    return values


def summary_json(summary: AuditSummary) -> dict[str, object]:
    return {
        "requests": summary.requests,
        "matched_tokens": summary.matched_tokens,
        "total_tokens": summary.total_tokens,
        "by_cause": dict(summary.by_cause),
        "ok": summary.ok,
    }
