"""Fitting the host term (`HostCost`) to a measured `tandem loadtest` run on the host a plan is
for: pure, over the rows of `cluster.plan.check`.

- The CPU a token, `t + (r + s / N) / E`, by least squares over the levels of more than one
  stream (a lone stream's CPU is mostly the service's idle work over few tokens), with every
  coefficient kept >= 0 (the best fit over the subsets of the three terms).
- The usable cores c and the CPU's critical share (`HostCost.critical_share`), by
  golden-section searches in turn (three rounds of coordinate descent) that minimise the
  squared log error of the predicted tokens/s over every level, the CPU a token fixed as
  fitted: the share is what a lone stream's rate says, the cores what the loaded levels do.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.plan.check import CheckRow, check_rows
from cluster.plan.inputs import HostCost, PlanInputs
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens

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
            coefficients = _least_squares([columns[i] for i in subset], measured)
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


def _least_squares(columns: list[list[float]], y: list[float]) -> list[float] | None:
    """The normal equations solved by Gaussian elimination; None if they are singular."""
    size = len(columns)
    a = [[sum(p * q for p, q in zip(ci, cj, strict=True)) for cj in columns] for ci in columns]
    b = [sum(p * q for p, q in zip(ci, y, strict=True)) for ci in columns]
    for col in range(size):
        pivot = max(range(col, size), key=lambda row: abs(a[row][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for row in range(size):
            if row != col:
                factor = a[row][col] / a[col][col]
                a[row] = [x - factor * z for x, z in zip(a[row], a[col], strict=True)]
                b[row] -= factor * b[col]
    return [b[i] / a[i][i] for i in range(size)]


def golden_minimum(f: Callable[[float], float], low: float, high: float, steps: int = 60) -> float:
    """The x in [low, high] minimising a unimodal f, by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def calibrate(
    inputs: PlanInputs, result: Mapping[str, Any], category: str, source: str = ""
) -> HostCost:
    """The host term fitted to the load test `result` (parsed JSON), whose levels must report
    their CPU by process (`tandem loadtest` does on a local service)."""
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
        host = _tuned(host, "usable_cores", error, low, high, math.exp)
        host = _tuned(host, "critical_share", error, *SHARE_RANGE, float)
    return host


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
