"""`tandem bench` on a simulated preset: runs, the ideal beside them, and a round's time split."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cluster.tools.bench.sim import STAGES, format_sim_table, is_sim_preset, run_sim_bench


def test_a_simulated_bench_reports_achieved_against_ideal_and_the_stages(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "Once upon a time"}\n')
    args = argparse.Namespace(
        preset="sim-h100-8b", mode="local", prompts=str(prompts), max_tokens=16,
        draft_tokens=4, repeats=1, serve_config=None, prompt_lookup=False,
        adaptive_draft=False, draft_quantization=None, draft_vocab=None,
    )  # fmt: skip
    assert is_sim_preset("sim-h100-8b") and not is_sim_preset("tiny")
    result = run_sim_bench(args, lambda message: None)
    assert set(result["runs"]) == {
        "tandem_target", "tandem_serial", "tandem_pipelined", "tandem_predrafted"
    }  # fmt: skip
    # Pre-drafting ran at the ideal's best fan-out, and some rounds hit.
    assert 0 < result["runs"]["tandem_predrafted"]["predraft_hit_rate"] <= 1
    assert result["runs"]["tandem_serial"]["predraft_hit_rate"] is None
    ideal = result["ideal"]
    assert ideal["target_only_tokens_per_s"] < ideal["serial_tokens_per_s"]
    # What outcome-keyed pre-drafting would reach, beside the rounds Tandem runs today.
    assert ideal["predrafted_tokens_per_s"] > ideal["pipelined_tokens_per_s"]
    assert 1 <= ideal["predraft_fan_out"] <= 8 and 0 < ideal["predraft_hit_rate"] <= 1
    for name, run in result["runs"].items():
        assert run["num_tokens"] == 32
        assert 0 < result["achieved_over_ideal"][name] < 1.5
    target = result["runs"]["tandem_target"]
    # The device's modelled 6.3+ ms a step is most of a target-only round.
    assert target["stages_ms_per_round"]["device"] > 6.3
    assert set(target["stages_ms_per_round"]) == set(STAGES)
    assert target["own_ms_per_round_p50"] > 0
    pipelined = result["runs"]["tandem_pipelined"]
    assert math.isnan(pipelined["stages_ms_per_round"]["device"])
    assert result["runs"]["tandem_serial"]["acceptance_rate"] > 0.3
    table = format_sim_table(result)
    assert "achieved/ideal" in table and "tandem_pipelined" in table
    assert "outcome-keyed pre-drafting" in table and "of its rounds hit a branch" in table
