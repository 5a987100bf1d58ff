"""Fitting the host term (`HostCost`) to a measured `tandem loadtest` run on the host a plan is
for: pure, over the rows of `cluster.plan.check`.

- The CPU a token, `t + (r + s / N) / E`, by least squares over the levels of more than one
  stream (a lone stream's CPU is mostly the service's idle work over few tokens), with every
  coefficient kept >= 0 (the best fit over the subsets of the three terms).
- The usable cores c and the CPU's critical share (`HostCost.critical_share`), by
  golden-section searches in turn (three rounds of coordinate descent) that minimise the
  squared log error of the predicted tokens/s over every level, the CPU a token fixed as
  fitted: the share is what a lone stream's rate says, the cores what the loaded levels do.
- For a preset whose "device" is the host's own cores (`PlanInputs.device_is_host`: a model on
  a CPU), whose forward passes slow down or speed up with the machine's state, first the
  device (`fit_device`): the target's step curve from the target-alone levels' ITL, its
  prefill from one stream's time to first token.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.plan.check import CheckRow, check_rows
from cluster.plan.inputs import HostCost, PlanInputs
from cluster.plan.solve import golden_minimum, least_squares
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens
from cluster.runtime.sim_source import DeviceProfile

CORES_RANGE = (0.25, 256.0)
"""The usable cores searched over."""
SHARE_RANGE = (0.02, 1.0)
"""The critical shares searched over."""
ROUNDS = 3


def fit_cpu(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """(t, r, s) >= 0 minimising the squared error of t + (r + s / N) / E against the measured
    CPU a token, over (N, E, cpu_ms) samples: the least-squares fit over each subset of the
    three terms, the best one whose coefficients are all >= 0."""
    if len(samples) < 2:
        raise InvalidArgumentError("calibration needs two levels of more than one stream")
    columns = [
        [1.0] * len(samples),
        [1.0 / e for _, e, _ in samples],
        [1.0 / (n * e) for n, e, _ in samples],
    ]
    measured = [cpu for _, _, cpu in samples]
    best: tuple[float, list[float]] = (math.inf, [0.0, 0.0, 0.0])
    for size in (1, 2, 3):
        for subset in itertools.combinations(range(3), size):
            coefficients = least_squares([columns[i] for i in subset], measured)
            if coefficients is None or min(coefficients) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, value in zip(subset, coefficients, strict=True):
                full[i] = value
            error = sum(
                (full[0] * a + full[1] * b + full[2] * c - y) ** 2
                for a, b, c, y in zip(*columns, measured, strict=True)
            )
            if error < best[0] - 1e-12:
                best = (error, full)
    t, r, s = best[1]
    return t, r, s


def calibrate(
    inputs: PlanInputs, result: Mapping[str, Any], category: str, source: str = ""
) -> PlanInputs:
    """`inputs` with the host term (and, where the device is the host, the device) fitted to
    the load test `result` (parsed JSON), whose levels must report their CPU by process
    (`tandem loadtest` does on a local service)."""
    if inputs.device_is_host:
        inputs = fit_device(inputs, result, source)
    rows = check_rows(inputs, result, category)
    samples = [
        (r.concurrency, _tokens_per_round(r), r.measured_host_cpu_ms_per_token)
        for r in rows
        if r.concurrency > 1 and r.measured_host_cpu_ms_per_token is not None
    ]
    t, r, s = fit_cpu(samples)
    host = dataclasses.replace(
        inputs.host,
        cpu_ms_per_token=t,
        cpu_ms_per_round=r,
        cpu_ms_per_step=s,
        latency_ms_per_round=0.0,
        source=source or inputs.host.source,
    )

    def error(trial: HostCost) -> float:
        return sum(math.log(row.ratio) ** 2 for row in check_rows(inputs, result, category, trial))

    low, high = (math.log(x) for x in CORES_RANGE)
    for _ in range(ROUNDS):
        # Where the device is the host's cores, the forward passes already hold them: the
        # preset's cores stand, and what is left to fit is how much of the rest delays a round.
        if not inputs.device_is_host:
            host = _tuned(host, "usable_cores", error, low, high, math.exp)
        host = _tuned(host, "critical_share", error, *SHARE_RANGE, float)
    return dataclasses.replace(inputs, host=host)


def fit_device(inputs: PlanInputs, result: Mapping[str, Any], source: str = "") -> PlanInputs:
    """`inputs` with the target's step refitted to the run: base + per token x N by least
    squares (kept >= 0) over its target-alone levels' ITL p50 (a decode step at N streams),
    and the prefill (both its terms) scaled by one stream's target-alone time to first token,
    less a step, over the prefill the figures give its prompts (`prompt_tokens`)."""
    points = []
    for level in result.get("levels") or []:
        alone = level.get("target_only") or {}
        itl = (alone.get("itl_ms") or {}).get("p50")
        if itl:
            points.append((int(level["concurrency"]), float(itl) / 1000.0))
    if len({n for n, _ in points}) < 2:
        raise InvalidArgumentError(
            "--calibrate: fitting the device needs target-only levels at two concurrencies"
        )
    fit = least_squares([[1.0] * len(points), [float(n) for n, _ in points]],
                         [step for _, step in points])  # fmt: skip
    base, per_token = fit if fit is not None and min(fit) >= 0 else (
        sum(step for _, step in points) / len(points), 0.0)  # fmt: skip
    target = DeviceProfile(
        base, per_token, inputs.target.per_context_s,
        source=f"fitted to the target-only ITL of {source or 'the run'}",
    )  # fmt: skip
    fitted = dataclasses.replace(inputs, target=target)
    first = _one_stream_first_token_s(result)
    shipped = inputs.prefill_s()
    if first is None or shipped <= 0:
        return fitted
    scale = max(first - target.step_s(1, 0), 0.0) / shipped
    linear = inputs.prefill_s_per_token
    squared = inputs.prefill_s_per_token_squared
    return dataclasses.replace(
        fitted,
        prefill_s_per_token=scale * (inputs.target.per_token_s if linear is None else linear),
        prefill_s_per_token_squared=scale
        * (inputs.target.per_context_s / 2 if squared is None else squared),
    )


def _one_stream_first_token_s(result: Mapping[str, Any]) -> float | None:
    for level in result.get("levels") or []:
        if int(level["concurrency"]) == 1:
            ttft = ((level.get("target_only") or {}).get("ttft_ms") or {}).get("p50")
            return float(ttft) / 1000.0 if ttft else None
    return None


def _tuned(
    host: HostCost,
    name: str,
    error: Callable[[HostCost], float],
    low: float,
    high: float,
    value: Callable[[float], float],
) -> HostCost:
    """`host` with its field `name` set to value(x), x in [low, high] minimising `error`."""

    def with_value(x: float) -> HostCost:
        changes: dict[str, Any] = {name: value(x)}
        return dataclasses.replace(host, **changes)

    return with_value(golden_minimum(lambda x: error(with_value(x)), low, high))


def _tokens_per_round(row: CheckRow) -> float:
    return expected_tokens(row.alpha, row.draft_tokens) if row.kind != "none" else 1.0
