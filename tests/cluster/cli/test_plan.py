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
    cores = json.loads(slow)["host"]["usable_cores"]
    assert json.loads(slow)["levels"][0]["mixed_tokens_per_s"] <= cores / 10e-3


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
    assert spec["kind"] == "model" and spec["draft_tokens"] == 4  # the run's sim draft
    assert "| 1 | speculative | model k 4 alpha 0.80 | 150.0 |" in run(capsys, "--check", str(path))


def loadtest_result() -> dict[str, object]:
    """A load test of three levels, its speculative levels drafting 7.5 suffix tokens a pass."""
    speculation = {"num_drafted": 900, "suffix_drafted": 880, "drafted_per_token": 0.9,
                   "passes_per_token": 0.12}  # fmt: skip
    levels = []
    for streams, alone, drafted, cpu_alone, cpu_drafted in (
        (1, 113.0, 530.0, 5.5, 1.6),
        (16, 880.0, 2500.0, 1.7, 0.57),
        (64, 1230.0, 3080.0, 1.44, 0.49),
    ):
        levels.append({
            "concurrency": streams,
            "target_only": {"tokens_per_s": alone,
                            "cpu_ms_per_token": {"service_total": cpu_alone}},
            "speculative": {"tokens_per_s": drafted, "speculation": speculation,
                            "cpu_ms_per_token": {"service_total": cpu_drafted}},
        })  # fmt: skip
    return {"config": {"max_tokens": 64}, "sim": {"context_tokens": 124.0}, "levels": levels}


def test_calibrate_fits_the_host_and_host_reuses_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "loadtest.json"
    path.write_text(json.dumps(loadtest_result()))
    fitted = json.loads(run(capsys, "--calibrate", str(path), "--json"))
    assert {r["kind"] for r in fitted["check"]} == {"suffix", "none"}
    assert all(0.5 < r["ratio"] < 2.0 for r in fitted["check"])
    assert fitted["host"]["cpu_ms_per_round"] > 0 and 0 < fitted["host"]["critical_share"] <= 1
    assert "host fitted to" in run(capsys, "--calibrate", str(path))
    host = tmp_path / "host.json"
    host.write_text(json.dumps(fitted))
    rows = json.loads(run(capsys, "--host", str(host), "--check", str(path), "--json"))
    assert [r["ratio"] for r in rows] == pytest.approx([r["ratio"] for r in fitted["check"]])
    plan = json.loads(run(capsys, "--host", str(host), "--clients", "64", "--json"))
    assert plan["host"]["usable_cores"] == pytest.approx(fitted["host"]["usable_cores"])


def test_prompt_and_output_lengths_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    short = json.loads(run(capsys, "--preset", "qwen-coder", "--clients", "1", "--json"))
    long = json.loads(
        run(capsys, "--preset", "qwen-coder", "--clients", "1", "--prompt-tokens", "2000",
            "--json")
    )  # fmt: skip
    assert long["context_tokens"] == 2000 + 32 // 2
    assert long["levels"][0]["mixed_tokens_per_s"] < short["levels"][0]["mixed_tokens_per_s"]


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
        (["--output-tokens", "0"], "output_tokens >= 1"),
        (["--prompt-tokens", "-5"], ">= 0"),
        (["--host", "/no/such/host.json"], "--host: cannot read"),
        (["--preset", "qwen-coder", "--sampled"], "--sampled: qwen-coder has no host term"),
    ],
)
def test_bad_flags_are_one_invalid_argument_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: INVALID_ARGUMENT: ") and message in err
    assert err.count("\n") == 1


def test_a_bad_host_file_is_one_invalid_argument_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for body, message in (
        ({"cores": 2}, "expected an object with usable_cores"),
        ({"usable_cores": 2, "cpu_ms_per_token": 1, "turbo": 1}, "unknown fields turbo"),
        ({"usable_cores": 2}, "--host:"),
        ({"usable_cores": 2, "cpu_ms_per_token": 1, "critical_share": 0}, "critical_share"),
    ):
        path = tmp_path / "host.json"
        path.write_text(json.dumps(body))
        assert main(["plan", "--host", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tandem: error: INVALID_ARGUMENT: ") and message in err


def test_sampled_requests_plan_with_their_own_host(capsys: pytest.CaptureFixture[str]) -> None:
    greedy = json.loads(run(capsys, "--clients", "64", "--json"))
    sampled = json.loads(run(capsys, "--clients", "64", "--sampled", "--json"))
    assert sampled["host"] != greedy["host"]
    assert (
        sampled["levels"][0]["mixed_target_alone_tokens_per_s"]
        < (greedy["levels"][0]["mixed_target_alone_tokens_per_s"])
    )
