"""A plan beside a measured run: each level of a `tandem loadtest` result (its parsed JSON)
with the tokens/s the plan predicts for it, their ratio, and the CPU the run spent.

The run fixes what the plan would otherwise choose: the draft model (`model` kind) at the
run's block length and alpha (a sim run's `sim` section names both; otherwise the block length
of its config, else 4, and the given acceptance) and, for a sim run, its mean context. Pure:
the caller reads the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.plan.inputs import TARGET_ALONE, HostCost, PlanInputs
from cluster.plan.model import estimate
from cluster.runtime.errors import InvalidArgumentError

DEFAULT_DRAFT_TOKENS = 4
"""The service's block length when a run names none (`RouterConfig`'s default)."""
MODES = {"speculative": "model", "target_only": TARGET_ALONE}
"""A load test's modes the plan predicts -> the kind it predicts them with."""


@dataclass(frozen=True)
class CheckRow:
    concurrency: int
    mode: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    measured_cpu_ms_per_token: float | None
    """service_total + load_client, as the host term counts it."""
    predicted_cpu_ms_per_token: float

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s

    @property
    def measured_cores(self) -> float | None:
        """Cores the run's processes kept busy: tokens/s x CPU a token."""
        if self.measured_cpu_ms_per_token is None:
            return None
        return self.measured_tokens_per_s * self.measured_cpu_ms_per_token / 1000.0


def check_rows(
    inputs: PlanInputs,
    result: Mapping[str, Any],
    category: str,
    host: HostCost | None = None,
) -> list[CheckRow]:
    """One row per level and predicted mode of the load test `result`."""
    levels = result.get("levels")
    if not isinstance(levels, list) or not levels:
        raise InvalidArgumentError("--check: not a tandem loadtest result (no levels)")
    sim = result.get("sim") or {}
    config = result.get("config") or {}
    k = int(sim.get("draft_tokens") or config.get("draft_tokens") or DEFAULT_DRAFT_TOKENS)
    if "alpha" in sim:
        alpha = float(sim["alpha"])
    else:
        alpha = float(inputs.acceptance.get(category, {}).get("model", 0.0))
    if "context_tokens" in sim:
        inputs = dataclasses.replace(inputs, context_tokens=round(float(sim["context_tokens"])))
    host = host or inputs.host
    rows = []
    for level in levels:
        concurrency = int(level["concurrency"])
        for mode, kind in MODES.items():
            if mode not in level:
                continue
            measured = level[mode]
            plan = estimate(inputs, kind, alpha, k, concurrency, 1, host)
            cpu = measured.get("cpu_ms_per_token") or {}
            spent = (
                cpu["service_total"] + cpu.get("load_client", 0.0)
                if "service_total" in cpu
                else None
            )
            rows.append(
                CheckRow(
                    concurrency=concurrency,
                    mode=mode,
                    measured_tokens_per_s=float(measured["tokens_per_s"]),
                    predicted_tokens_per_s=plan.tokens_per_s,
                    measured_cpu_ms_per_token=spent,
                    predicted_cpu_ms_per_token=host.cpu_ms(concurrency),
                )
            )
    return rows
