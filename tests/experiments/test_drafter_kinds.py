"""The drafter-kinds probe's own logic, without a model: its settings, the order and tenants of
its runs, and the per-category summary."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from experiments.drafter_kinds import TARGET, main, measure, settings, summarize


def test_settings_parse_suffix_fields_and_refuse_others() -> None:
    assert settings(["tokens_per_match=0", "min_match=3", "scope=request"]) == {
        "tokens_per_match": 0,
        "min_match": 3,
        "scope": "request",
    }
    with pytest.raises(ValueError, match="not a suffix drafter setting"):
        settings(["nope=1"])
    with pytest.raises(ValueError, match="tokens_per_match"):
        settings(["tokens_per_match=-1"])


def test_a_bad_variant_is_refused_before_a_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--variant", "min_match=0"])
    assert "min_match" in capsys.readouterr().err


def test_every_mode_runs_every_prompt_as_a_tenant_per_mode_and_repeat() -> None:
    """Modes rotate, each (mode, repeat) is its own tenant, and output is compared with the
    target's; the summary sums tokens over each prompt's median seconds."""
    calls: list[tuple[str, tuple[int, ...], str]] = []

    def mode(name: str, output: tuple[int, ...], drafted: int) -> Any:
        def generate(ids: tuple[int, ...], tenant: str) -> tuple[tuple[int, ...], Any]:
            calls.append((name, ids, tenant))
            stats = SimpleNamespace(
                num_drafted=drafted, num_accepted=drafted // 2,
                suffix_drafted=drafted // 2, suffix_accepted=drafted // 4,
            )  # fmt: skip
            return output, stats

        return generate

    modes = {TARGET: mode(TARGET, (1, 2), 0), "suffix+model": mode("suffix+model", (1, 2), 8)}
    tallies = measure(modes, [(5,), (6,)], repeats=2, say=lambda line: None)
    assert len(calls) == 8
    assert {tenant for name, _, tenant in calls if name == TARGET} == {"target-0", "target-1"}
    assert [name for name, _, _ in calls[:4]] == [TARGET, "suffix+model", "suffix+model", TARGET]
    speculative = tallies["suffix+model"]
    assert all(t.same_as_target for t in speculative)
    assert speculative[0].drafted == 16 and speculative[0].suffix_accepted == 4
    args = argparse.Namespace(
        preset="p", prompts=None, categories=None, repeats=2, max_tokens=2, draft_tokens=4,
        self_preset=None,
    )  # fmt: skip
    result = summarize(args, ["code", "prose"], tallies)
    code = result["by_category"]["code"]["modes"]["suffix+model"]
    assert code["suffix_share"] == 0.5 and code["suffix_acceptance"] == 0.5
    assert code["model_acceptance"] == 0.5 and code["same_as_target"] == 1
    assert result["by_category"]["all"]["prompts"] == 2
