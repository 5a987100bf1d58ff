"""The small numerical solvers the planning math shares: a root of an increasing function, the
minimum of a unimodal one, and linear least squares. Pure; no I/O."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

STEPS = 60
"""Halvings (bisection) or golden-section steps: far below a float's resolution on [0, 1]."""


def increasing_root(
    f: Callable[[float], float], target: float, low: float = 0.0, high: float = 1.0
) -> float:
    """The x in [low, high] with f(x) = target, for f increasing there, by bisection (an end
    of the interval when the target lies beyond it)."""
    for _ in range(STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low + high) / 2


def golden_minimum(f: Callable[[float], float], low: float, high: float) -> float:
    """The x in [low, high] minimising a unimodal f, by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float] | None:
    """Coefficients of `columns` fitting `y` best in squares; None where the columns do not
    determine them (fewer independent samples than columns)."""
    a = np.array(columns, dtype=float).T
    coefficients, _, rank, _ = np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)
    return [float(c) for c in coefficients] if rank == len(columns) else None
