"""`tandem generate --local`: the JSON contract, streaming text, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = ["generate", "--local", "--preset", "tiny", "--max-tokens", "24"]


def run_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    assert main([*BASE, *flags, "--json", "def add(a, b):"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "--draft-tokens", "4")
    for field in ("tokens", "text", "num_drafted", "num_accepted", "num_verify_passes"):
        assert field in result
    assert isinstance(result["tokens"], list) and len(result["tokens"]) == 24
    assert result["finish_reason"] == "length"
    assert result["num_accepted"] + result["num_verify_passes"] == 24  # type: ignore[operator]


def test_draft_tokens_zero_is_the_same_greedy_output(capsys: pytest.CaptureFixture[str]) -> None:
    speculative = run_json(capsys, "--draft-tokens", "6")
    target_only = run_json(capsys, "--draft-tokens", "0")
    assert speculative["tokens"] == target_only["tokens"]
    assert target_only["num_drafted"] == 0
    assert target_only["num_verify_passes"] == 24


def test_seeded_sampling_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "42")
    assert run_json(capsys, *flags)["tokens"] == run_json(capsys, *flags)["tokens"]


def test_streams_text_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    streamed_code = main([*BASE, "def add(a, b):"])
    streamed = capsys.readouterr().out
    assert streamed_code == 0
    assert streamed == run_json(capsys)["text"] + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "-1"], "max_tokens must be >= 1, got -1"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p"),
        (["--draft-tokens", "99"], "draft_tokens must be in 0..32"),
        (["--seed", "-4"], "seed"),
        (["--device", "tpu"], "device"),
    ],
)
def test_bad_flags_get_a_clear_error(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*BASE, *flags, "hello"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tandem: error:")
    assert "Traceback" not in err


def test_empty_prompt_and_missing_local(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, ""]) == 2
    assert "prompt must not be empty" in capsys.readouterr().err
    assert main(["generate", "hello"]) == 2
    assert "needs --local" in capsys.readouterr().err


def test_unknown_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--local", "--preset", "nope", "hi"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_end_to_end() -> None:
    """The installed `tandem` entry point, as a user runs it, for a result and an error."""
    tandem = Path(sys.executable).with_name("tandem")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    ok = subprocess.run(
        [str(tandem), *BASE, "--json", "def add(a, b):"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["tokens"]) == 24
    bad = subprocess.run(
        [str(tandem), *BASE, "--temperature", "nan", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert bad.returncode == 2
    assert "temperature" in bad.stderr and "Traceback" not in bad.stderr
