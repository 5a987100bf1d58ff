"""GenerationRequest validation: every bad field gets a precise InvalidArgumentError."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(prompt_tokens=()), "prompt must not be empty"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=-3), "max_tokens must be >= 1, got -3"),
        (dict(seed=-1), "seed"),
        (dict(draft_tokens=-1), "draft_tokens must be in 0..32"),
        (dict(draft_tokens=33), "draft_tokens"),
        (dict(predraft_fan_out=-1), "predraft_fan_out must be in 0..8, got -1"),
        (dict(predraft_fan_out=9), "predraft_fan_out must be in 0..8, got 9"),
        (dict(stop=("",)), "stop sequences must not be empty"),
        (dict(stop=tuple("abcdefghijklmnopq")), "at most 16 stop sequences"),
    ],
)
def test_bad_fields(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = dict(prompt_tokens=(1, 2), max_tokens=8) | changes
    with pytest.raises(InvalidArgumentError, match=message):
        GenerationRequest(**fields)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -0.5])
def test_bad_temperature(temperature: float) -> None:
    with pytest.raises(InvalidArgumentError, match="temperature"):
        SamplingParams(temperature=temperature)


def test_acceptance_rate() -> None:
    assert math.isnan(SpeculationStats().acceptance_rate)
    assert SpeculationStats(num_drafted=8, num_accepted=6).acceptance_rate == 0.75
