"""A plan for one load: per category the kind and block length to use, what it yields against
the target alone, the drafter replicas each kind needs per verifier and the streams one
verifier serves; then the categories mixed. Built from `cluster.plan.model`; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.plan.inputs import TARGET_ALONE, HostCost, PlanInputs
from cluster.plan.model import (
    Estimate,
    best_estimate,
    clients_per_verifier,
    estimate,
    mixed_tokens_per_s,
)
from cluster.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class CategoryPlan:
    category: str
    best: Estimate
    """The kind and k with the most tokens/s (the target alone when nothing beats it)."""
    target_alone: Estimate
    by_kind: dict[str, Estimate]
    """Each drafting kind at its own best k: for drafters per verifier of every kind."""
    clients_per_verifier: int
    """Streams one verifier serves with `best`'s kind and k: within the target ITL, or at
    saturation without one (`cluster.plan.model.clients_per_verifier`)."""

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.target_alone.tokens_per_s


@dataclass(frozen=True)
class LevelPlan:
    clients: int
    verifiers: int
    categories: list[CategoryPlan]
    mixed_tokens_per_s: float
    """An equal share of tokens from every category, each with its best plan."""
    mixed_target_alone_tokens_per_s: float

    @property
    def mixed_speedup(self) -> float:
        return self.mixed_tokens_per_s / self.mixed_target_alone_tokens_per_s

    def itl_ms(self, tokens_per_s: float) -> float:
        return self.clients / tokens_per_s * 1000.0


def plan_level(
    inputs: PlanInputs,
    clients: int,
    categories: Sequence[str],
    verifiers: int = 1,
    itl_ms: float | None = None,
    host: HostCost | None = None,
) -> LevelPlan:
    """The plan for `clients` streams over `verifiers` verifiers, for each of `categories`."""
    if not categories:
        raise InvalidArgumentError("no categories to plan for")
    plans = []
    for category in categories:
        best = best_estimate(inputs, category, clients, verifiers, host)
        alone = estimate(inputs, TARGET_ALONE, 0.0, 0, clients, verifiers, host)
        by_kind = {
            kind: max(
                (
                    estimate(inputs, kind, alpha, k, clients, verifiers, host)
                    for k in range(1, inputs.max_draft_tokens + 1)
                ),
                key=lambda e: e.tokens_per_s,
            )
            for kind, alpha in inputs.acceptance[category].items()
            if kind != TARGET_ALONE
        }
        served = clients_per_verifier(
            inputs, best.kind, best.alpha, best.draft_tokens, itl_ms, host
        )
        plans.append(CategoryPlan(category, best, alone, by_kind, served))
    return LevelPlan(
        clients=clients,
        verifiers=verifiers,
        categories=plans,
        mixed_tokens_per_s=mixed_tokens_per_s([p.best.tokens_per_s for p in plans]),
        mixed_target_alone_tokens_per_s=mixed_tokens_per_s(
            [p.target_alone.tokens_per_s for p in plans]
        ),
    )
