"""`tandem plan` from a fresh clone: the shipped figures, tables and JSON, `--check` against a
load test's JSON, and bad flags as one INVALID_ARGUMENT line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["plan", *flags]) == 0
    return capsys.readouterr().out


def test_plan_prints_a_table_per_load(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--preset", "sim-h100-8b", "--clients", "1", "16", "64")
    for clients in (1, 16, 64):
        assert f"{clients} clients, 1 verifier(s):" in out
    assert out.count("| mix (equal tokens) |") == 3
    for category in ("agentic", "summarise", "reasoning"):
        assert f"| {category} |" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--clients", "1", "64", "--category", "agentic", "--json")
    plan = json.loads(out)
    assert [level["clients"] for level in plan["levels"]] == [1, 64]
    (agentic,) = plan["levels"][0]["categories"]
    assert agentic["category"] == "agentic" and agentic["best"]["kind"] != "none"
    one, many = (level["mixed_tokens_per_s"] for level in plan["levels"])
    assert many > one > 0


def test_overrides_reach_the_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    table = tmp_path / "acceptance.json"
    table.write_text(json.dumps({"chat": {"model": 0.0}}))
    out = run(capsys, "--acceptance", str(table), "--clients", "4", "--json")
    (chat,) = json.loads(out)["levels"][0]["categories"]
    assert chat["best"]["kind"] == "none"  # alpha 0: never speculate
    slow = run(capsys, "--clients", "64", "--cpu-ms-per-token", "10", "--json")
    assert json.loads(slow)["levels"][0]["mixed_tokens_per_s"] <= 1.48 / 10e-3


def test_check_puts_prediction_beside_a_loadtest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    level = {"tokens_per_s": 150.0, "cpu_ms_per_token": {"service_total": 3.0, "load_client": 0.2}}
    result = {
        "config": {"draft_tokens": None},
        "sim": {"alpha": 0.8, "draft_tokens": 4, "context_tokens": 124.0},
        "levels": [{"concurrency": 1, "speculative": level, "target_only": level}],
    }
    path = tmp_path / "loadtest.json"
    path.write_text(json.dumps(result))
    rows = json.loads(run(capsys, "--check", str(path), "--json"))
    assert [r["mode"] for r in rows] == ["speculative", "target_only"]
    spec, alone = rows
    assert spec["measured_tokens_per_s"] == 150.0
    assert spec["ratio"] == pytest.approx(spec["predicted_tokens_per_s"] / 150.0)
    assert spec["predicted_tokens_per_s"] > alone["predicted_tokens_per_s"]
    assert spec["measured_cpu_ms_per_token"] == pytest.approx(3.2)
    assert "| 1 | speculative | 150.0 |" in run(capsys, "--check", str(path))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--preset", "tiny"], "--preset: no planning figures for 'tiny'"),
        (["--clients", "0"], "--clients and --verifiers must be >= 1"),
        (["--category", "poetry"], "--category: no acceptance figures for poetry"),
        (["--acceptance", "/no/such/file.json"], "--acceptance: cannot read /no/such/file.json"),
        (["--itl-ms", "-1"], "the target ITL must be > 0 ms"),
        (["--cores", "0"], "usable_cores must be > 0"),
        (["--check", "/no/such/loadtest.json"], "--check: cannot read"),
    ],
)
def test_bad_flags_are_one_invalid_argument_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: INVALID_ARGUMENT: ") and message in err
    assert err.count("\n") == 1
