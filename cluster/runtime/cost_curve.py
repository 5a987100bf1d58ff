"""The engine's running estimates: the step cost curve and the smoothing of its other figures.

`CostCurve` fits step seconds = base + per_token x tokens by exponentially weighted least
squares over recent steps (`COST_DECAY`); the engine seeds it with `calibrate` at startup,
feeds it every step, publishes the line in `StepLoad` (the router prices speculation under load
with it) and sizes its gather window from it. `smooth` is the exponential moving average
(`STATS_DECAY`) behind the engine's mean batch, mean step tokens, queue wait and each
session's return time. Pure numbers in and out.
"""

from __future__ import annotations

COST_DECAY = 0.98
"""Weight kept by past steps in the cost-curve fit (about the last 50 steps count)."""
STATS_DECAY = 0.9
"""Weight kept by the smoothed figures per step or call."""


class CostCurve:
    """Step seconds against step tokens: an exponentially weighted least-squares line."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self._decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(base_s, per_token_s), both >= 0; (0, 0) before any step."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):  # one step size seen so far: no slope
            return mean_y, 0.0
        slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        base = max(0.0, mean_y - slope * mean_x)
        return base, slope


def smooth(old: float, new: float, first: bool = False) -> float:
    """`new` folded into the moving average `old` (`new` itself when `first`)."""
    return new if first else STATS_DECAY * old + (1 - STATS_DECAY) * new
