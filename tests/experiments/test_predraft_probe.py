"""The pre-drafting probe runs both caps on a pair in process and reports their ratio."""

from __future__ import annotations

import pytest

from experiments.predraft_probe import main


def test_the_probe_reports_both_caps_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "tiny", "--num-prompts", "2", "--repeats", "1", "--max-tokens", "12",
            "--fan-out", "3"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "fan-out up to 0: median" in captured.out
    assert "fan-out up to 3: median" in captured.out
    assert "with pre-drafting / without: " in captured.out
    # Every prompt ran under both caps.
    assert captured.err.count("fan-out up to 0:") == captured.err.count("fan-out up to 3:") == 2


def test_a_fan_out_out_of_range_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--fan-out", "9"])
