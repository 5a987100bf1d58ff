"""The goodput model: what a round plan is worth in tokens per second, and the best plan.

Pure arithmetic, no I/O. A `Plan` is a round's block length k, whether the next block is drafted
while this one is verified (pipelined), and for a pipelined round how many branches are
pre-drafted for the likeliest outcomes of its verify pass (`fan_out`). Each is priced with the
Leviathan et al. model: at acceptance `a`, E(k) = (1 - a^(k+1)) / (1 - a) tokens a verify pass
(`expected_tokens`, less the bonus a pipelined round defers), over the expected wall time of the
round from the seconds per drafted token and of a verify pass (`pass_seconds`; a verify cost may
be a function of the block's length, and a pipelined round may be priced with the times of both
sides working at once). A pre-drafted round is priced by `cluster.routing.predraft_budget`.

Contract: `best_plan` is the plan with the most tokens per second among k in 0..max_k, serial or
(if allowed) pipelined, with any fan-out the pre-draft cost offers; on ties serial, then the
shortest block, then the narrowest fan-out. k = 0 (the target alone) wins when drafting costs
more than it saves. What feeds it (estimates of `a` and the times) is
`cluster.routing.draft_length`'s; the model, term by term: docs/architecture.md, "Adaptive
plan: the model".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.routing.predraft_budget import PredraftCost, predrafted_seconds

VerifyCost = float | Callable[[int], float]
"""Seconds of a verify pass: a constant, or a function of the block's length (under load)."""


def expected_tokens(acceptance: float, k: int, pipelined: bool = False) -> float:
    """Tokens one verify pass of a k-token block commits: 1 + a + ... + a^k, less the bonus
    token that a pipelined round defers when all k are accepted."""
    tokens = float(sum(acceptance**i for i in range(k + 1)))
    return tokens - acceptance**k if pipelined and k > 0 else tokens


def verify_seconds(verify_s: VerifyCost, k: int) -> float:
    """Seconds of a verify pass of a k-token block."""
    return verify_s(k) if callable(verify_s) else verify_s


def pass_seconds(
    acceptance: float,
    k: int,
    draft_s: float,
    verify_s: VerifyCost,
    pipelined: bool,
    overlapped: tuple[float, VerifyCost] | None = None,
) -> float:
    """Expected wall time of one round with a k-token block. `overlapped` is (draft_s,
    verify_s) while a draft and a verify pass run at once, when sharing the machine makes them
    slower than alone; by default the same as alone. A missed draft ahead is redrafted alone."""
    if not pipelined or k == 0:
        return k * draft_s + verify_seconds(verify_s, k)
    draft_beside, verify_beside = overlapped or (draft_s, verify_s)
    waited = max(verify_seconds(verify_beside, k), k * draft_beside)
    return waited + (1 - acceptance**k) * k * draft_s


@dataclass(frozen=True)
class Plan:
    """How the next round runs: its block length, and whether the block after it is drafted
    while this one is verified."""

    k: int
    pipelined: bool
    fan_out: int = 0
    """A pipelined round's branches, pre-drafted for the likeliest outcomes of its verify pass
    (`cluster.routing.predraft_budget`); 0: it drafts ahead as if all of the block were
    accepted."""


def rate(
    acceptance: float,
    plan: Plan,
    draft_s: float,
    verify_s: VerifyCost,
    overlapped: tuple[float, VerifyCost] | None = None,
    predraft: PredraftCost | None = None,
) -> float:
    """Expected tokens per second of rounds run to `plan` (`predraft`: what its fan-out
    costs, needed for a plan with one)."""
    if plan.fan_out > 0:
        assert predraft is not None, "a plan with a fan-out is priced with its cost"
        verify_beside = (overlapped or (draft_s, verify_s))[1]
        seconds = predrafted_seconds(
            predraft.hit(acceptance, plan.k, plan.fan_out),
            verify_seconds(verify_beside, plan.k),
            predraft.seconds(plan.k, plan.fan_out),
            plan.k * draft_s,
        )
        return expected_tokens(acceptance, plan.k) / seconds
    tokens = expected_tokens(acceptance, plan.k, plan.pipelined)
    seconds = pass_seconds(acceptance, plan.k, draft_s, verify_s, plan.pipelined, overlapped)
    return tokens / seconds


def best_plan(
    acceptance: float,
    max_k: int,
    draft_s: float,
    verify_s: VerifyCost,
    may_pipeline: bool,
    overlapped: tuple[float, VerifyCost] | None = None,
    predraft: PredraftCost | None = None,
) -> Plan:
    """The plan with the most tokens per second; on ties serial, then the shortest block,
    then the narrowest fan-out."""
    plans = [Plan(k, False) for k in range(max_k + 1)]
    if may_pipeline:
        plans += [Plan(k, True) for k in range(1, max_k + 1)]
    priced = [
        (rate(acceptance, p, draft_s, verify_s, overlapped), not p.pipelined, -p.k, 0, p)
        for p in plans
    ]
    if may_pipeline and predraft is not None:
        verify_beside = (overlapped or (draft_s, verify_s))[1]
        for k in range(1, max_k + 1):
            tokens, verify_k = expected_tokens(acceptance, k), verify_seconds(verify_beside, k)
            for fan_out, value in predraft.rates(acceptance, k, tokens, verify_k, k * draft_s):
                priced.append((value, False, -k, -fan_out, Plan(k, True, fan_out)))
    return max(priced, key=lambda p: p[:4])[4]


def model_pays(
    acceptance: float, max_k: int, draft_s: float, verify_s: Callable[[int], float]
) -> bool:
    """Whether the best plan at `acceptance` drafts at all, with `draft_s` seconds a drafted
    token and `verify_s(k)` seconds a verify pass of k: what the replicas' start-up
    measurement says of the draft model before a request has timed a round."""
    return best_plan(acceptance, max_k, draft_s, verify_s, may_pipeline=True).k > 0
