"""A plan beside a measured run: each level of a `tandem loadtest` result (its parsed JSON)
with the tokens/s the plan predicts for it, their ratio, and the CPU the run spent.

The run fixes what the plan would otherwise choose. A speculative level that reports what it
speculated (`speculation`: drafted tokens and verify passes per generated token, suffix-drafted
tokens) is priced as it ran: the kind that drafted most of its tokens (`suffix` or `model`), k
its drafted tokens a pass rounded, and the alpha whose k-token blocks commit its measured
tokens a pass; a level that drafted (almost) nothing, as the target alone. An older run is
priced with the draft model at the run's block length and alpha (a sim run's `sim` section
names both; otherwise the block length of its config, else 4, and the given acceptance).
Requests generate the run's `max_tokens`; a sim run gives its mean prompt and context. Pure:
the caller reads the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.plan.inputs import TARGET_ALONE, HostCost, PlanInputs
from cluster.plan.model import estimate
from cluster.plan.solve import increasing_root
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens

DEFAULT_DRAFT_TOKENS = 4
"""The service's block length when a run names none (`RouterConfig`'s default)."""
MODES = {"speculative": "model", "target_only": TARGET_ALONE}
"""A load test's modes the plan predicts -> the kind it predicts them with (when the level does
not report what it speculated)."""
MIN_DRAFTED_PER_PASS = 0.05
"""Below this many drafted tokens a verify pass a level is priced as the target alone."""


@dataclass(frozen=True)
class CheckRow:
    concurrency: int
    mode: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    measured_cpu_ms_per_token: float | None
    """service_total + load_client: every process of the run."""
    predicted_cpu_ms_per_token: float
    measured_host_cpu_ms_per_token: float | None = None
    """The measured CPU less the suffix drafter's processes (whose lookups a plan prices
    apart) and, where the device is the host's cores, the verifier's and drafter's (their
    forward passes are the device): what `HostCost` models."""
    kind: str = "model"
    """The kind the level was priced as."""
    draft_tokens: int = 0
    alpha: float = 0.0

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
    if "mean_prompt_tokens" in sim:
        inputs = dataclasses.replace(inputs, prompt_tokens=round(float(sim["mean_prompt_tokens"])))
    if config.get("max_tokens"):
        inputs = dataclasses.replace(inputs, output_tokens=int(config["max_tokens"]))
    host = host or inputs.host
    rows = []
    for level in levels:
        concurrency = int(level["concurrency"])
        for mode, kind in MODES.items():
            if mode not in level:
                continue
            measured = level[mode]
            priced, draft_tokens, level_alpha, share = kind, k, alpha, 1.0
            if kind != TARGET_ALONE and "speculation" in measured:
                priced, draft_tokens, level_alpha = priced_as_run(measured["speculation"])
                share = drafting_share(measured["speculation"], draft_tokens)
            plan = estimate(inputs, priced, level_alpha, draft_tokens, concurrency, 1, host, share)
            cpu = measured.get("cpu_ms_per_token") or {}
            spent = (
                cpu["service_total"] + cpu.get("load_client", 0.0)
                if "service_total" in cpu
                else None
            )
            apart = ("suffix", "verifier", "drafter") if inputs.device_is_host else ("suffix",)
            host_spent = (
                spent - sum(cpu.get(role, 0.0) for role in apart) if spent is not None else None
            )
            rows.append(
                CheckRow(
                    concurrency=concurrency,
                    mode=mode,
                    measured_tokens_per_s=float(measured["tokens_per_s"]),
                    predicted_tokens_per_s=plan.tokens_per_s,
                    measured_cpu_ms_per_token=spent,
                    predicted_cpu_ms_per_token=plan.cpu_ms_per_token,
                    measured_host_cpu_ms_per_token=host_spent,
                    kind=priced,
                    draft_tokens=plan.draft_tokens,
                    alpha=plan.alpha,
                )
            )
    return rows


def priced_as_run(speculation: Mapping[str, Any]) -> tuple[str, int, float]:
    """(kind, k, alpha) of a level from what it speculated (`tandem loadtest`'s
    `speculation`): the target alone where it drafted under `MIN_DRAFTED_PER_PASS` tokens a
    pass; else the kind that drafted most tokens, k its drafted tokens a pass (rounded, at
    least 1) and the alpha at which k-token blocks commit its tokens a pass."""
    passes = float(speculation.get("passes_per_token") or 0.0)
    drafted = float(speculation.get("drafted_per_token") or 0.0)
    if passes <= 0 or drafted / passes < MIN_DRAFTED_PER_PASS:
        return TARGET_ALONE, 0, 0.0
    per_pass = drafted / passes
    k = max(1, round(per_pass))
    suffix = float(speculation.get("suffix_drafted") or 0.0)
    total = float(speculation.get("num_drafted") or 0.0)
    kind = "suffix" if total > 0 and suffix / total > 0.5 else "model"
    return kind, k, alpha_for_tokens(1.0 / passes, k)


def drafting_share(speculation: Mapping[str, Any], draft_tokens: int) -> float:
    """The share of a level's rounds that drafted, as k-token blocks: its drafted tokens a pass
    over k, at most 1."""
    passes = float(speculation.get("passes_per_token") or 0.0)
    if passes <= 0 or draft_tokens < 1:
        return 0.0
    drafted = float(speculation.get("drafted_per_token") or 0.0)
    return min(1.0, drafted / passes / draft_tokens)


def alpha_for_tokens(tokens_per_pass: float, k: int) -> float:
    """The alpha at which k-token blocks commit `tokens_per_pass` tokens a verify pass
    (`expected_tokens` increases with alpha), clamped to [0, 1]."""
    if tokens_per_pass <= 1.0:
        return 0.0
    if tokens_per_pass >= k + 1:
        return 1.0
    return increasing_root(lambda alpha: expected_tokens(alpha, k), tokens_per_pass)
