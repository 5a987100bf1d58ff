"""The ideal beside a load test on a simulated device: pure arithmetic, no I/O.

A service running a simulated preset (`cluster.runtime.sim`) spends a modelled time per
forward pass; `sim.ideal_rates` gives the aggregate tokens/s a perfect system would reach with
those costs at a number of concurrent streams. `tandem loadtest --preset sim-...` puts that
ideal next to each level's achieved rate:

- `speculative`: the better of serial and pipelined rounds (the service pipelines by
  default), at the draft's agreement alpha and the requests' block length k;
- `serial` (`tandem loadtest --predraft`): serial rounds alone;
- `predrafted` (the same): the best of those and outcome-keyed
  pre-drafting at its best fan-out (`sim.ideal_rates`), which the adaptive plan's budget may
  narrow or turn off under load;
- `target_only`: one target pass a token (draft length 0).

Every stream is taken at the run's mean context: the mean prompt length in tokens plus half of
`max_tokens` (a request's mean context over its generation). A target that costs nothing (the
`instant` profile) has no finite ideal: its rates and ratios are None.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.runtime.sim import ideal_rates
from cluster.runtime.sim_source import DeviceProfile, SimSource

MODES = ("speculative", "serial", "predrafted", "target_only")
"""The modes of a load test that have an ideal (the HF baseline has none)."""


@dataclass(frozen=True)
class SimIdeal:
    """What the ideal of every level depends on but the number of streams."""

    preset: str
    target_source: str
    draft_source: str
    target: DeviceProfile
    draft: DeviceProfile
    alpha: float
    draft_tokens: int
    context_tokens: float
    mean_prompt_tokens: float

    @classmethod
    def from_sources(
        cls,
        preset: str,
        target_source: str,
        draft_source: str,
        draft_tokens: int,
        prompt_lengths: Sequence[int],
        max_tokens: int,
    ) -> SimIdeal:
        """From the preset's sim sources (`ValueError` if they are not), the requests' block
        length, the prompts' lengths in tokens and the requests' `max_tokens`."""
        target, draft = SimSource.parse(target_source), SimSource.parse(draft_source)
        mean_prompt = mean_prompt_tokens(prompt_lengths)
        return cls(
            preset=preset,
            target_source=target_source,
            draft_source=draft_source,
            target=target.profile,
            draft=draft.profile,
            alpha=draft.alpha,
            draft_tokens=draft_tokens,
            context_tokens=mean_prompt + max_tokens / 2,
            mean_prompt_tokens=mean_prompt,
        )

    def describe(self) -> dict[str, Any]:
        """The JSON's `sim`: what the ideal of every level was computed from."""
        return {
            "preset": self.preset, "target": self.target_source, "draft": self.draft_source,
            "alpha": self.alpha, "draft_tokens": self.draft_tokens,
            "mean_prompt_tokens": self.mean_prompt_tokens,
            "context_tokens": self.context_tokens,
        }  # fmt: skip

    def level(self, streams: int) -> dict[str, float | None]:
        """The ideal aggregate tokens/s at `streams` concurrent streams: `speculative` (the
        better of `serial` and `pipelined`), `predrafted` (the best of those and outcome-keyed
        pre-drafting at its best fan-out, with that fan-out and its hit rate) and
        `target_only`; None where unbounded."""
        context = round(self.context_tokens)
        if self.target.step_s(streams, streams * context) <= 0:
            return {
                "speculative_tokens_per_s": None, "serial_tokens_per_s": None,
                "pipelined_tokens_per_s": None, "predrafted_tokens_per_s": None,
                "predraft_fan_out": None, "predraft_hit": None,
                "target_only_tokens_per_s": None, "tokens_per_verify": None,
            }  # fmt: skip
        rates = ideal_rates(
            self.target, self.draft, self.alpha, self.draft_tokens, streams, context
        )
        return {
            "speculative_tokens_per_s": max(rates.serial, rates.pipelined),
            "serial_tokens_per_s": rates.serial,
            "pipelined_tokens_per_s": rates.pipelined,
            "predrafted_tokens_per_s": max(rates.serial, rates.pipelined, rates.predrafted),
            "predraft_fan_out": rates.predraft_fan_out,
            "predraft_hit": rates.predraft_hit,
            "target_only_tokens_per_s": rates.target_only,
            "tokens_per_verify": rates.tokens_per_verify,
        }


def mean_prompt_tokens(prompt_lengths: Sequence[int]) -> float:
    if not prompt_lengths:
        raise ValueError("no prompts")
    return float(statistics.mean(prompt_lengths))


def achieved_over_ideal(achieved: float, ideal: float | None) -> float | None:
    """achieved / ideal; None when the ideal is unbounded (None) or not positive."""
    return achieved / ideal if ideal is not None and ideal > 0 else None


def ideal_of_level(sim: SimIdeal, level: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a level gains: `ideal` (`SimIdeal.level` at its concurrency) and
    `achieved_over_ideal` (per mode it ran among `MODES`: its tokens/s over its ideal)."""
    ideal = sim.level(int(level["concurrency"]))
    ratios = {
        mode: achieved_over_ideal(level[mode]["tokens_per_s"], ideal[f"{mode}_tokens_per_s"])
        for mode in MODES
        if mode in level
    }
    return {"ideal": ideal, "achieved_over_ideal": ratios}
