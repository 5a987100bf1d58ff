"""The step-curve study times every form at every row count and prints the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.step_curve import host_line, main, table


def test_the_study_prints_a_row_per_form_and_a_cell_per_row_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--preset", "tiny", "--rows", "1", "3", "--repeats", "1", "--context", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host: ")
    for form in ("target bf16", "target fp32", "target int8", "draft"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {form} |"))
        assert row.count("|") == 4  # the form and two row counts
        assert f"draft step / {form} step:" in out or form == "draft"


def test_the_table_gives_each_pass_over_its_own_one_row_pass() -> None:
    text = table({"target bf16": [0.1, 0.25]}, [1, 5])
    assert "| target bf16 | 100 ms | 250 (2.50x) |" in text


def test_the_host_line_names_the_instruction_sets(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_bf16\n")
    assert host_line(cpuinfo) == "Some CPU (avx2, avx512f, amx_bf16)"
    cpuinfo.write_text("model name\t: Old CPU\nflags\t\t: fpu sse2\n")
    assert host_line(cpuinfo).startswith("Old CPU (none of avx2")
    assert host_line(tmp_path / "absent") == "unknown"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--rows", "0"])
