"""bench_report: the Markdown text carries every run and line; the plot writes a real PNG."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.runtime.errors import InvalidArgumentError
from cluster.tools.bench.output import pyplot
from cluster.tools.bench.report import MISSING, format_table, plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_NAMES = ["hf_target", "hf_assisted", "tandem_target", "tandem_serial", "tandem_pipelined"]


def tandem_run(tokens_per_s: float, acceptance_rate: float | None) -> dict[str, Any]:
    return {
        "tokens_per_s": tokens_per_s,
        "ms_per_token": 1000.0 / tokens_per_s,
        "num_tokens": 512,
        "acceptance_rate": acceptance_rate,
        "mean_tokens_per_verify": 3.1 if acceptance_rate is not None else 1.0,
        "acceptance_by_position": [0.9, 0.75, 0.6, 0.45] if acceptance_rate is not None else [],
        "ideal_speedup": 2.4 if acceptance_rate is not None else None,
    }


def make_result() -> dict[str, Any]:
    pipelined = tandem_run(61.0, 0.72) | {"pipeline_hit_rate": 0.81}
    return {
        "config": {
            "preset": "qwen-0.5b-7b",
            "mode": "local",
            "max_tokens": 128,
            "draft_tokens": 4,
            "dtype": "bf16",
            "repeats": 3,
            "num_prompts": 4,
        },
        "runs": {
            "hf_target": {"tokens_per_s": 40.0, "ms_per_token": 25.0, "num_tokens": 512},
            "hf_assisted": {"tokens_per_s": 55.5, "ms_per_token": 18.02, "num_tokens": 512},
            "tandem_target": tandem_run(37.9, None),
            "tandem_serial": tandem_run(51.7, 0.72),
            "tandem_pipelined": pipelined,
        },
        "speedup": {
            "vs_hf_target": 1.5203,
            "vs_hf_assisted": 1.099,
            "vs_tandem_target": 1.6095,
            "pipelining": 1.18,
        },
        "greedy_match": {"matched": 4, "total": 4},
        "by_category": {
            "code": {
                "acceptance_rate": 0.85,
                "acceptance_by_position": [0.95, 0.88, 0.8, 0.7],
                "tokens_per_s": {"tandem_pipelined": 70.2},
            },
            "chat": {
                "acceptance_rate": 0.64,
                "acceptance_by_position": [0.85, 0.66, 0.5, 0.38],
                "tokens_per_s": {"tandem_pipelined": 55.0},
            },
            "math": {
                "acceptance_rate": None,
                "acceptance_by_position": [],
                "tokens_per_s": {"tandem_pipelined": 58.4},
            },
        },
    }


def test_table_has_a_row_per_run_and_the_summary_lines() -> None:
    text = format_table(make_result())
    for name in RUN_NAMES:
        assert f"| {name} " in text
    assert (
        "speedup: 1.52x vs HF target, 1.10x vs HF assisted, 1.61x vs Tandem target-only, "
        "1.18x from pipelining"
    ) in text
    assert "greedy match (fp32): 4/4 prompts" in text
    assert "| tandem_pipelined | 61.0 " in text
    assert "81.0%" in text


def test_none_and_absent_values_print_as_missing() -> None:
    lines = format_table(make_result()).splitlines()
    hf_row = next(line for line in lines if line.startswith("| hf_target "))
    # HF runs have no acceptance, tokens/verify, pipeline hits or ideal speedup.
    assert hf_row.count(MISSING) == 4
    target_row = next(line for line in lines if line.startswith("| tandem_target "))
    assert target_row.count(MISSING) == 3
    math_row = next(line for line in lines if line.startswith("| math "))
    assert MISSING in math_row
    assert "58.4" in math_row


def test_category_table_lists_every_category() -> None:
    text = format_table(make_result())
    assert "| category " in text
    assert "acceptance (tandem_pipelined)" in text
    for category in ("code", "chat", "math"):
        assert f"| {category} " in text


def test_draft_forms_and_settings_are_tabled_when_measured() -> None:
    result = make_result()
    assert "| draft " not in format_table(result)
    result["config"]["settings"] = {"draft_quantization": "int8", "draft_vocab": 65536}
    result["draft_forms"] = [
        {"quantization": "int8", "vocab": 65536, "ms_per_token": 70.04,
         "agreement": {"code": 0.9, "prose": 0.6, "all": 0.8}},
    ]  # fmt: skip
    text = format_table(result)
    assert "settings: draft_quantization=int8, draft_vocab=65536" in text
    assert "| draft | vocab | ms/token | agree code | agree prose | agree all |" in text
    assert "| int8  | 65536 | 70.0     | 90.0%      | 60.0%       | 80.0%     |" in text


def test_plot_writes_a_png_and_skips_empty_categories(tmp_path: Path) -> None:
    path = tmp_path / "bench.png"
    plot(make_result(), path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


def test_plot_accepts_a_string_path_with_no_positions_at_all(tmp_path: Path) -> None:
    result = make_result()
    for stats in result["by_category"].values():
        stats["acceptance_by_position"] = []
    path = tmp_path / "empty.png"
    plot(result, str(path))
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_service_mode_tables_cpu_per_token_by_role() -> None:
    """--mode service: a row per Tandem run that measured its processes' CPU; none otherwise."""
    assert "CPU ms per generated token" not in format_table(make_result())
    result = make_result()
    result["cpu_scope"] = "the Ray cluster of /tmp/x/ray and its descendants"
    per_token = {"router": 0.9, "proxy": 0.5, "verifier": 0.6, "service_total": 2.0,
                 "load_client": 0.2}  # fmt: skip
    for name in ("tandem_target", "tandem_serial", "tandem_pipelined"):
        result["runs"][name]["cpu_ms_per_token"] = per_token
    text = format_table(result)
    assert "CPU ms per generated token, by process role (the Ray cluster of /tmp/x/ray" in text
    assert "| run | router | proxy | controller |" in text
    assert "| tandem_serial | 0.900 | 0.500 | – |" in text
    assert "| hf_target | 0.9" not in text


def test_plotting_without_matplotlib_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """matplotlib is the `plot` extra: without it, `--plot` is refused with the install line."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(InvalidArgumentError, match=r"pip install 'tandem\[plot\]'"):
        pyplot()
